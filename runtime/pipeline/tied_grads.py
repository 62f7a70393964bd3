"""Parameters held by several stages (tied embeddings: stage 0 and the last stage each keep a copy,
Megatron's embedding group) and the sum of their gradients across the holders after a step, so the
copies stay equal under any optimizer.

    holders = shared_params(plan, captured, graphs)     # placeholder -> (stages, rank groups)
    sum_tied_gradients(holders, stages, captured, env, device, zeros, ties)   # after the last backward
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from autoshard.passes.graph import META
from autoshard.passes.spec import Replicate

from ..layout import shard_tensor
from ..redistribute import redistribute

__all__ = ["shared_params", "sum_tied_gradients"]


def shared_params(plan: Any, captured: Any, graphs: list) -> dict[str, tuple[list[int], tuple[int, ...]]]:
    """param placeholder -> (stages holding it, the distinct rank groups holding them), for the
    parameters that two or more of ``graphs`` (the plan's stage graphs) read."""
    out = {}
    for ph in captured.params:
        holders = [g.index for g in graphs if ph in g.captured.params]
        if len(holders) > 1:
            out[ph] = (holders, tuple(sorted({plan.stages[s].group for s in holders})))
    return out


def sum_tied_gradients(holders: dict, stages: dict, captured: Any, env: Any, device: Any, zeros: Any,
                       ties: Optional[Any]) -> None:
    """Set every local copy's gradient of each shared parameter to the sum over all its holders.

    ``stages``: this rank's lowered stages by index, the sum built on ``device``; ``zeros`` (``stage_zeros.StageZeros``) sums the
    slices of a parameter held in a ZeRO form itself; ``ties`` (``pipeline.groups.TieGroups``, None
    without a pipeline) all-reduces the sum across rank groups when the holders span several."""
    for ph, (holding, groups) in holders.items():
        mine = [stages[s] for s in holding if s in stages]
        if not mine:
            continue
        if zeros.tied_sum(mine, ph, ties.get(groups) if len(groups) > 1 else None):
            continue
        meta = captured.node(ph).meta[META]
        total = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
        for st in mine:
            p = st.params[st.param_names.index(ph)]
            if p.grad is not None:
                total += redistribute(p.grad, st.grad_layout(ph), (Replicate(),) * env.mesh.ndim, env)
        if len(groups) > 1:
            dist.all_reduce(total, group=ties.get(groups))
        for st in mine:
            p = st.params[st.param_names.index(ph)]
            if p.requires_grad:
                p.grad = shard_tensor(total, st.grad_layout(ph), env.mesh.shape, env.coordinate).clone()
