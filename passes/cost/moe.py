"""Pricing mixture-of-experts layers (``autoshard::moe_experts``): work, all-to-all, load imbalance.

- Work: ``moe_flops`` counts the routed pairs' GEMMs, ``2 * T * k * 3 * H * I`` forward (gate, up,
  down); the backward is twice that (input and weight gradients).
- All-to-all (``dispatch_collectives``): under ``expert_dispatch`` each mesh axis where the tokens
  are ``S(0)`` moves every pair's hidden row to its expert's rank and back: forward dispatch +
  combine, backward the adjoint pair. A rank sends ``T_local * k * H`` elements each way (pairs of
  a filter axis, tokens ``R``, are split over it); the collective's full group bytes are that times
  the axis size. Over several dispatch axes (one flattened group at run time) each axis is priced as
  its own all-to-all of the same bytes, as a hierarchical all-to-all runs.
- Load imbalance (``imbalance``): with the experts cut into ``c`` contiguous chunks over the mesh
  (the product of the axes where the experts are ``S(0)``), the slowest rank computes the busiest
  chunk. Its share of the pairs times ``c`` multiplies the evenly divided work (1 for uniform load).
  The loads come from ``ExpertLoad``, which the user passes as ``plan(..., expert_load=...)``: one
  sequence of per-expert token counts (or shares) for every MoE layer, or a dict from MoE layer
  index (program order) to such a sequence; layers without one are uniform.
- Memory (``dispatch_saved_bytes``): autograd keeps the rows a rank received (its experts recompute
  the rest in the backward) and the rows that came back, twice the bytes sent each way. They are attached to
  the capture (``attach_expert_load``) and read back here; the receiving side of the all-to-all is
  priced at the busiest chunk's share too.

Without a capacity factor tokens are never dropped: the runtime exchanges the split sizes and moves
every pair (``runtime/moe_dispatch.py``). With one (``capacity_factor_of`` > 0: the op's static-shape
formulation, lowering ``expert_dispatch_capacity``) every expert computes its capacity rows
(``ceil(factor * pairs / E)`` per dispatching group) and the all-to-all moves the padded buffers:
work and bytes scale with the factor, not with the load, and pairs beyond capacity are dropped.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Union

import torch.fx as fx

from autoshard.passes.capture.moe_experts import capacity_factor_of, is_moe_node, moe_nodes
from autoshard.passes.errors import AutoshardError
from autoshard.passes.graph import operand_meta, operands
from autoshard.passes.sharding.rules.moe import DISPATCH_LOWERINGS, moe_flops
from autoshard.passes.spec import Replicate, Shard, Strategy, TensorMeta

__all__ = ["MOE_OP", "EXPERT_LOAD_META", "is_moe_node", "moe_flops", "moe_nodes", "attach_expert_load",
           "expert_load_of", "imbalance", "capacity_factor_of", "work_factor", "dispatch_collectives",
           "dispatch_saved_bytes", "ExpertLoadError"]


MOE_OP = "moe_experts"
#: node.meta key holding a MoE layer's per-expert load shares (summing to 1)
EXPERT_LOAD_META = "autoshard_expert_load"

ExpertLoad = Union[Sequence[float], Mapping[int, Sequence[float]]]


class ExpertLoadError(AutoshardError, ValueError):
    """``expert_load`` does not fit the model's MoE layers."""


def attach_expert_load(gm: fx.GraphModule, expert_load: Optional[ExpertLoad]) -> None:
    """Record per-expert load shares on each MoE node of ``gm`` (None: uniform, clears them)."""
    nodes = moe_nodes(gm)
    for n in nodes:
        n.meta.pop(EXPERT_LOAD_META, None)
    if expert_load is None:
        return
    if not nodes:
        raise ExpertLoadError("expert_load was given but the model has no MoE layer autoshard recognises "
                              "(autoshard::moe_experts); drop expert_load or capture with fuse_experts=True")
    per_layer = dict(expert_load) if isinstance(expert_load, Mapping) else {i: expert_load for i in range(len(nodes))}
    for i, load in per_layer.items():
        if not isinstance(i, int) or not 0 <= i < len(nodes):
            raise ExpertLoadError(f"expert_load key {i!r}: the model has MoE layers 0..{len(nodes) - 1}")
        experts = operand_meta(operands(nodes[i])[3]).shape[0]
        values = [float(v) for v in load]
        if len(values) != experts or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
            raise ExpertLoadError(f"expert_load for MoE layer {i}: give {experts} non-negative token counts or "
                                  f"shares (one per expert, not all zero), got {len(values)} values")
        total = sum(values)
        nodes[i].meta[EXPERT_LOAD_META] = tuple(v / total for v in values)


def expert_load_of(node: fx.Node) -> Optional[tuple[float, ...]]:
    return node.meta.get(EXPERT_LOAD_META)


def _expert_chunks(strategy: Strategy, mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape[a] for a, p in enumerate(strategy.inputs[3]) if isinstance(p, Shard) and p.dim == 0)


def imbalance(load: Optional[Sequence[float]], chunks: int) -> float:
    """Busiest of ``chunks`` contiguous expert chunks' share of the pairs, times ``chunks`` (>= 1)."""
    if not load or chunks <= 1:
        return 1.0
    per = len(load) // chunks
    return chunks * max(sum(load[c * per:(c + 1) * per]) for c in range(chunks))


def _capacity_rows(pairs: float, experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * pairs / experts))


def work_factor(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int]) -> float:
    """What the evenly divided work of a MoE node is multiplied by on its busiest rank: the load
    imbalance over expert chunks, or with a capacity factor the padding to capacity (every expert
    computes its capacity whatever its load)."""
    factor = capacity_factor_of(node)
    if factor > 0:
        index = operand_meta(operands(node)[1])
        experts = operand_meta(operands(node)[3]).shape[0]
        return _capacity_rows(index.numel, experts, factor) * experts / index.numel
    return imbalance(expert_load_of(node), _expert_chunks(strategy, mesh_shape))


def _dispatch_axes(strategy: Strategy, mesh: Sequence[int]) -> tuple[list[int], list[int]]:
    axes = [a for a, low in enumerate(strategy.lowerings) if low in DISPATCH_LOWERINGS and mesh[a] > 1]
    return axes, [a for a in axes if isinstance(strategy.inputs[0][a], Shard)]


def dispatch_collectives(cm, node: fx.Node, strategy: Strategy, out: TensorMeta, training: bool) -> tuple:
    """The all-to-alls ``expert_dispatch`` runs for ``node`` (forward, then backward when training)."""
    mesh = cm.mesh.shape
    axes, dispatch = _dispatch_axes(strategy, mesh)
    if not dispatch:
        return ()
    local = _sent_bytes(node, strategy, out, mesh, axes)
    fwd = [cm.collective("all_to_all", a, local * mesh[a]) for a in dispatch for _ in range(2)]
    bwd = [cm.collective("all_to_all", c.axis, c.bytes, "bwd") for c in fwd] if training else []
    return tuple(fwd + bwd)


def dispatch_saved_bytes(cm, node: fx.Node, strategy: Strategy, out: TensorMeta) -> float:
    """Bytes autograd keeps of an expert-parallel layer's moved rows: the rows it received (the local
    experts keep their input, recomputing the rest) and the rows that came back (the combine keeps
    them); 0 when nothing is dispatched. ``cm``: the ``CostModel``."""
    mesh = cm.mesh.shape
    axes, dispatch = _dispatch_axes(strategy, mesh)
    return 2 * _sent_bytes(node, strategy, out, mesh, axes) if dispatch else 0.0


def _sent_bytes(node: fx.Node, strategy: Strategy, out: TensorMeta, mesh: Sequence[int], axes: list[int]) -> float:
    """Bytes of the rows one rank sends (and, on the busiest rank, receives) each way."""
    k = operand_meta(operands(node)[1]).shape[1]
    token_split = math.prod(mesh[a] for a, p in enumerate(strategy.inputs[0]) if isinstance(p, Shard))
    filters = math.prod(mesh[a] for a in axes if isinstance(strategy.inputs[0][a], Replicate))
    factor = capacity_factor_of(node)
    if factor > 0:  # a padded buffer of (group, local experts, capacity) rows, whatever the load
        tokens = out.shape[0] / token_split
        experts = operand_meta(operands(node)[3]).shape[0]
        local = out.nbytes / out.shape[0] * _capacity_rows(tokens * k, experts, factor) * experts / filters
    else:
        busiest = imbalance(expert_load_of(node), _expert_chunks(strategy, mesh))
        local = out.nbytes * k / token_split / filters * busiest
    return local
