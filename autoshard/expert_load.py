"""``measure_expert_load``: how many routed (token, expert) pairs each expert of each MoE layer gets on
sample batches, in the form ``plan(..., expert_load=...)`` takes.

    load = autoshard.measure_expert_load(model, [batch1, batch2])     # {layer: [pairs per expert]}
    plan = autoshard.plan(model, mesh, example_inputs=..., expert_load=load)

Counts every experts module ``passes.capture.moe_experts`` recognises (those capture turns into
``autoshard::moe_experts``), in the order they run, so layer ``i`` is the ``i``-th MoE op of the
captured program. The model runs under ``torch.no_grad`` in its current mode; nothing is changed.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

from autoshard.passes.capture.moe_experts import is_fusable_experts

__all__ = ["measure_expert_load"]


def measure_expert_load(model: nn.Module, batches: Iterable[Any]) -> dict[int, list[int]]:
    """Pairs routed to each expert, per MoE layer, summed over ``batches`` (each a tuple of positional
    inputs, a dict of keyword inputs or one tensor)."""
    experts = [m for m in model.modules() if is_fusable_experts(m) is not None]
    if not experts:
        raise ValueError("measure_expert_load: the model has no MoE experts module autoshard recognises "
                         "(transformers' Mixtral / Qwen2-MoE / DeepSeek-V3 style experts)")
    order: dict[int, int] = {}
    counts: dict[int, torch.Tensor] = {}

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        layer = order.setdefault(id(module), len(order))
        found = torch.bincount(index.reshape(-1).cpu(), minlength=module.gate_up_proj.shape[0])
        counts[layer] = counts.get(layer, 0) + found

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts]
    try:
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, Mapping):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
    finally:
        for h in handles:
            h.remove()
    return {layer: [int(c) for c in counts[layer]] for layer in sorted(counts)}
