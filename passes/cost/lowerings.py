"""The special lowerings a sharding rule may name, one ``Lowering`` descriptor each, registered here once.

A strategy's ``lowerings[a]`` names the lowering used on mesh axis ``a`` instead of running the
ATen op on local pieces (several axes with one name act as one flattened axis). A descriptor says
what the lowering does (``doc``, the contract the runtime's emitter implements) and what it costs
beyond the op's work divided over the mesh, through optional hooks the cost model calls for every
lowering a strategy names (``CostModel.price_node`` and ``node_activation_bytes``; recomputation
runs its forward ``collectives`` again, ``passes.solve.lever_costs``):

- ``price(cm, node, strategy, fwd, bwd)``: exposed seconds added to the op's compute (``fwd`` /
  ``bwd``: its one-device compute seconds);
- ``collectives(cm, node, strategy, out, training)``: the ``Collective``s it runs itself (forward,
  then the backward's when ``training``);
- ``saved_bytes(cm, node, strategy, out)``: local bytes autograd keeps of what it moves (training only);
- ``internal_bytes(node)``: what it keeps inside itself (whole op, split like its work), replacing
  what the saved-tensor analysis found inside the unsplit op.

A lowering without hooks costs what its placements imply. The runtime registers an emitter under
each name (``runtime/lowerings.py``, ``EMITTERS``); ``tests/runtime/test_lowering_registry.py``
checks that every descriptor has one and no emitter lacks a descriptor. Adding a lowering: a
``Lowering`` in ``LOWERINGS`` below (with its hooks, or a module of them as ``attention`` and
``moe``), its emitter, and the rule that names it (``docs/extension.md``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.fx as fx

from autoshard.passes.cost.attention import ring_attention_seconds, ring_internal_bytes
from autoshard.passes.cost.collectives import Collective
from autoshard.passes.cost.moe import dispatch_collectives, dispatch_saved_bytes
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import operand_meta, operands
from autoshard.passes.schema import bind_args
from autoshard.passes.sharding.rules.moe import EXPERT_DISPATCH, EXPERT_DISPATCH_CAPACITY
from autoshard.passes.spec import Strategy, TensorMeta

__all__ = ["Lowering", "LOWERINGS", "named_lowerings"]


@dataclass(frozen=True)
class Lowering:
    """One special lowering: its ``name`` (what strategies carry), ``doc`` (what the runtime does)
    and its cost hooks (module docstring; None: nothing beyond the placements)."""
    name: str
    doc: str
    price: Optional[Callable] = None
    collectives: Optional[Callable] = None
    saved_bytes: Optional[Callable] = None
    internal_bytes: Optional[Callable] = None


_DISPATCH = dict(collectives=dispatch_collectives, saved_bytes=dispatch_saved_bytes)


def _group_all_reduce(cm, strategy: Strategy, name: str, nbytes: float, phase: str) -> tuple[Collective, ...]:
    """One all-reduce of ``nbytes`` over the axes (size > 1) where ``strategy`` names lowering
    ``name``, flattened into one group as the runtime's emitters call it (``runtime/lowerings.py``,
    ``emit_lowering``): none when no such axis is left. Its seconds are those of an all-reduce on
    each axis in turn (reducing over one axis, then the next, sums over the flattened group, so
    the one call costs no more), plus one op launch."""
    axes = [a for a, low in enumerate(strategy.lowerings) if low == name and cm.mesh.shape[a] > 1]
    if not axes:
        return ()
    seconds = sum(cm.collective_time("all_reduce", a, nbytes) for a in axes) + cm.hardware.op_overhead_s
    return (Collective("all_reduce", axes[0], int(nbytes), seconds, phase),)


def loss_mean_partial_collectives(cm, node: fx.Node, strategy: Strategy, out: TensorMeta,
                                  training: bool) -> tuple[Collective, ...]:
    """With class indices (cross_entropy / nll_loss: ``ignore_index`` and an integer target) the
    emitter all-reduces the local total weight, one scalar of the loss's dtype, outside autograd
    (forward only); any other loss divides by a static count and communicates nothing."""
    bound = bind_args(node.target, node.args, node.kwargs)
    if "ignore_index" not in bound or operand_meta(operands(node)[1]).dtype.is_floating_point:
        return ()
    scalar = TensorMeta((), operand_meta(operands(node)[0]).dtype).nbytes
    return _group_all_reduce(cm, strategy, "loss_mean_partial", scalar, "fwd")


def batch_norm_sync_collectives(cm, node: fx.Node, strategy: Strategy, out: TensorMeta,
                                training: bool) -> tuple[Collective, ...]:
    """In training the emitter all-reduces the per-channel sums of ``x - K`` and ``(x - K)^2``
    (2 x channels of the input's dtype) in one call, differentiably: the backward all-reduces
    their gradient once more (when the program trains). In eval the op runs as is."""
    if not bind_args(node.target, node.args, node.kwargs).get("training"):
        return ()
    x = operand_meta(operands(node)[0])
    stats = 2 * x.shape[1] * TensorMeta((), x.dtype).nbytes
    fwd = _group_all_reduce(cm, strategy, "batch_norm_sync", stats, "fwd")
    bwd = _group_all_reduce(cm, strategy, "batch_norm_sync", stats, "bwd") if training else ()
    return fwd + bwd

LOWERINGS: dict[str, Lowering] = {low.name: low for low in (
    Lowering("mean_partial",
             "aten.mean over dims that include a dim sharded on these axes: output P on these axes; each rank "
             "computes mean(local) * (local count of reduced elements) / (global count)."),
    Lowering("loss_mean_partial",
             "aten.cross_entropy_loss / aten.nll_loss / aten.mse_loss / aten.l1_loss / "
             "aten.binary_cross_entropy_with_logits with reduction=mean whose batch (or element) dims are sharded "
             "on these axes: output P; each rank computes its local sum of per-element losses divided by the "
             "GLOBAL number of counted elements (for ignore_index / class weights: the global total weight, "
             "obtained by an all-reduce of the local total weight over these axes, outside autograd).",
             collectives=loss_mean_partial_collectives),
    Lowering("batch_norm_sync",
             "aten.batch_norm (training) with the batch/spatial dims of its input sharded on these axes: mean and "
             "variance are computed over the GLOBAL batch (sum, sum of squares and count all-reduced over these "
             "axes, differentiably), running stats updated with the global statistics; output placed like input.",
             collectives=batch_norm_sync_collectives),
    Lowering("embedding_vocab",
             "aten.embedding with weight S(0) (vocabulary rows) on these axes and indices R: each rank looks up "
             "the rows it owns, zeros elsewhere; output P."),
    Lowering(EXPERT_DISPATCH,
             "autoshard::moe_experts with the experts S(0) on these axes: on an axis where the tokens are S(0), "
             "each (token, expert) pair travels to its expert's rank and back by an uneven all-to-all (split sizes "
             "exchanged first; nothing dropped), output S(0); where the tokens are R, each rank computes only its "
             "own experts' pairs, output P (runtime/moe_dispatch.py). Priced by passes/cost/moe.py.",
             **_DISPATCH),
    Lowering(EXPERT_DISPATCH_CAPACITY,
             "expert_dispatch for autoshard::moe_experts with a capacity factor: static shapes; each rank sends "
             "every member of the group a block of (local experts x capacity) rows by an even all-to-all, pairs "
             "beyond an expert's capacity dropped (runtime/moe_dispatch.py). Priced by passes/cost/moe.py.",
             **_DISPATCH),
    Lowering("ring_attention",
             "aten.scaled_dot_product_attention (no dropout) with q S(L), k/v S(S), mask S on its query dim, "
             "output S(L) on these axes: ring attention over the axes flattened (runtime/ring_attention.py), "
             "key/value chunks passed around the ring, partial outputs merged by log-sum-exp; causal masks by "
             "global position, causal self-attention without a mask balanced by zig-zag halves (permuted inside "
             "the lowering). Priced by passes/cost/attention.py.",
             price=ring_attention_seconds, internal_bytes=ring_internal_bytes),
)}


def named_lowerings(strategy: Strategy) -> list[Lowering]:
    """The descriptors of the lowerings ``strategy`` names (on any axis), each once, in axis order."""
    found: list[Lowering] = []
    for name in strategy.lowerings:
        if name is not None and all(low.name != name for low in found):
            if name not in LOWERINGS:
                raise PlanFormatError(f"strategy {strategy} names the lowering {name!r}, which is not registered; "
                                      f"known: {sorted(LOWERINGS)} (passes/cost/lowerings.py)")
            found.append(LOWERINGS[name])
    return found
