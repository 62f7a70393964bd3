"""Sharding rules for ops that make tensors: factories, ``*_like``, ``new_*``, ``tril``/``triu``.

- ``arange``/``ones``/``full``/``empty``/``scalar_tensor``: replicated only (their sizes are not
  rewritten, so every rank makes the whole tensor). ``zeros`` may also be ``P`` (zeros sum to zeros).
- ``zeros_like``/``ones_like``/``empty_like``/``full_like``/``rand_like``/``randn_like``: the output
  follows the input's split (``S(d) -> S(d)``). A partial input has the full shape, so it gives a
  whole output (``P -> R``), and ``zeros_like`` may also stay ``P``. ``rand_like``/``randn_like``
  draw different numbers on each rank, as dropout does (same distribution, different values than a
  single-device run).
- ``new_zeros``/``new_ones``/``new_empty``/``new_full`` (sizes rewritten to local sizes by the
  runtime): ``self`` lends only its dtype and device, so any placement of ``self`` is accepted:
  ``R -> S(d)`` for each splittable output dim, ``S(d) -> S(d)`` where the output has that dim too,
  ``X -> R`` for every non-``R`` placement ``X`` of ``self``, and for ``new_zeros`` ``R -> P``, ``P -> P``.
- ``tril``/``triu``: leading (batch) dims shard, the last two stay whole (the diagonal offset is
  global); linear, so ``P -> P``.
- ``lift_fresh_copy``: a copy: any split or ``P`` passes through.
- ``_assert_tensor_metadata``: checks dtype/device/layout only when ``size``/``stride`` are unset,
  which hold on any local piece, so every placement is accepted (no outputs); with a size or
  stride it stays replicated.
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["replicated_factory_rule", "zeros_rule", "like_rule", "new_rule", "tril_rule", "lift_rule",
           "assert_metadata_rule"]


@register_rule(aten.arange, aten.ones, aten.full, aten.empty, aten.scalar_tensor, float_partials_only=True)
def replicated_factory_rule(call: OpCall) -> list[Strategy1D]:
    return []


@register_rule(aten.zeros, float_partials_only=True)
def zeros_rule(call: OpCall) -> list[Strategy1D]:
    return [Strategy1D((), (P,))]


_ZERO_LIKE = {"zeros_like", "new_zeros"}


@register_rule(aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
               aten.randn_like, float_partials_only=True)
def like_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    found = [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape)]
    if call.op_name in ("rand_like", "randn_like"):
        return found
    found.append(Strategy1D((P,), (R,)))
    if call.op_name in _ZERO_LIKE:
        found.append(Strategy1D((P,), (P,)))
    return found


def _self_options(shape) -> list[Placement]:
    return [P] + [Shard(d) for d in split_dims(shape)]


@register_rule(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, float_partials_only=True)
def new_rule(call: OpCall) -> list[Strategy1D]:
    x, out = call.inputs[0], call.outputs[0]
    out_dims = split_dims(out.shape)
    found = [Strategy1D((R,), (Shard(d),)) for d in out_dims]
    found += [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape) if d in out_dims]
    found += [Strategy1D((p,), (R,)) for p in _self_options(x.shape)]
    if call.op_name in _ZERO_LIKE:
        found += [Strategy1D((R,), (P,)), Strategy1D((P,), (P,))]
    return found


@register_rule(aten.tril, aten.triu, aten.tril_, aten.triu_, float_partials_only=True)
def tril_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    lead = [d for d in split_dims(x.shape) if d < len(x.shape) - 2]
    found = [Strategy1D((Shard(d),), (Shard(d),)) for d in lead]
    return found + [Strategy1D((P,), (P,))]


@register_rule(aten.lift_fresh_copy.default, float_partials_only=True)
def lift_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    found = [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape)]
    return found + [Strategy1D((P,), (P,))]


@register_rule(aten._assert_tensor_metadata.default, float_partials_only=True)
def assert_metadata_rule(call: OpCall) -> list[Strategy1D]:
    args = call.bound_args
    if args.get("size") is not None or args.get("stride") is not None or not call.inputs:
        return []
    return [Strategy1D((p,), ()) for p in _self_options(call.inputs[0].shape)]
