"""Sharding rules for reductions (sum, mean, max, var, norm, ...) and scans (softmax, cumsum).

A dim that is kept passes its sharding through; where it lands in the output depends on
``keepdim``: with ``keepdim=True`` at the same index, otherwise shifted left by the number of
reduced dims before it.

>>> # sum(x: (4, 6, 8), dim=[1]) -> (4, 8)
>>> # S(0) -> S(0);  S(2) -> S(1);  S(1) -> P  (each rank sums its rows: a summand of the total)

Reducing a sharded dim is allowed only where the local results combine by a sum:

- ``sum``: ``S(d) -> P`` over a reduced ``d``; ``P -> P``.
- ``mean``: ``S(d) -> P`` with the lowering ``"mean_partial"`` (local mean rescaled by
  local count / global count); ``P -> P`` plainly (a mean of summands is a summand of the mean).
- ``max``/``min``/``amax``/``amin``/``var``/``std``/``prod``/``argmax``/``logsumexp``/``norm``/
  ``all``/``any``: never (there is no partial-max placement); kept dims shard.

``histc`` with a fixed range (``min < max``) counts elements into bins: any split of its input
gives partial histograms, ``S(d) -> P`` (a range taken from the data, ``min == max``, is not split).

Scans work along one dim: ``softmax``/``log_softmax``/``cumsum``/``diff``/... shard every dim but
that one; ``cumsum`` and ``diff`` are linear, so ``P -> P``.
"""
from __future__ import annotations

from typing import Optional

import torch

from autoshard.passes.spec import Partial, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import norm_dim, norm_dims, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
P = Partial()

__all__ = ["reduction_strategies", "sum_rule", "mean_rule", "no_partial_reduction_rule", "histc_rule", "scan_rule"]


def _reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    """(reduced dims, keepdim). A missing, ``None`` or empty ``dim`` reduces every dim."""
    args = call.bound_args
    ndim = len(call.inputs[0].shape)
    return norm_dims(args.get("dim"), ndim), bool(args.get("keepdim") or False)


def reduction_strategies(call: OpCall, on_reduced: Optional[str]) -> list[Strategy1D]:
    """Strategies of a one-operand reduction.

    ``on_reduced``: what splitting a reduced dim gives: ``None`` (not allowed), ``"sum"`` (output
    ``P``) or ``"mean"`` (output ``P`` under the ``"mean_partial"`` lowering).
    """
    x = call.inputs[0]
    reduced, keepdim = _reduced_dims(call)
    n_out = len(call.outputs)
    found = []
    for d in split_dims(x.shape):
        if d in reduced:
            if on_reduced is None:
                continue
            lowering = "mean_partial" if on_reduced == "mean" else None
            found.append(Strategy1D((Shard(d),), (P,) * n_out, lowering))
        else:
            out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
            found.append(Strategy1D((Shard(d),), (Shard(out_d),) * n_out))
    return found


@register_rule(aten.sum.default, aten.sum.dim_IntList, float_partials_only=True)
def sum_rule(call: OpCall) -> list[Strategy1D]:
    return reduction_strategies(call, on_reduced="sum") + [Strategy1D((P,), (P,))]


@register_rule(aten.mean.default, aten.mean.dim, float_partials_only=True)
def mean_rule(call: OpCall) -> list[Strategy1D]:
    found = reduction_strategies(call, on_reduced="mean")
    found.append(Strategy1D((P,), (P,)))
    return found


@register_rule(
    aten.amax, aten.amin, aten.max.dim, aten.min.dim, aten.max.default, aten.min.default,
    aten.var, aten.std, aten.var_mean, aten.std_mean, aten.prod, aten.argmax, aten.argmin,
    aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.all, aten.any,
    float_partials_only=True,
)
def no_partial_reduction_rule(call: OpCall) -> list[Strategy1D]:
    return reduction_strategies(call, on_reduced=None)


@register_rule(aten.histc.default, float_partials_only=True)
def histc_rule(call: OpCall) -> list[Strategy1D]:
    args = call.bound_args
    if not float(args["min"]) < float(args["max"]):
        return []
    return [Strategy1D((Shard(d),), (P,)) for d in split_dims(call.inputs[0].shape)]


_LINEAR_SCANS = {"cumsum", "cumsum_", "diff"}


@register_rule(
    aten.softmax.int, aten._softmax, aten.log_softmax.int, aten._log_softmax, aten._safe_softmax,
    aten.cumsum, aten.cumsum_, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin, aten.diff,
    float_partials_only=True,
)
def scan_rule(call: OpCall) -> list[Strategy1D]:
    """Ops along one dim: every other dim shards; each output follows. ``diff``'s ``prepend`` and
    ``append`` operands match ``self`` off the dim, so they shard with it."""
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    n_in, n_out = len(call.inputs), len(call.outputs)
    found = [Strategy1D((Shard(d),) * n_in, (Shard(d),) * n_out) for d in split_dims(x.shape) if d != dim]
    name = call.op_name
    if name in _LINEAR_SCANS:
        found.append(Strategy1D((P,) * n_in, (P,)))
    return found
