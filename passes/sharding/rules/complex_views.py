"""Sharding rules for complex numbers: the complex views, ``polar``/``complex``, real and imaginary parts.

Meta's reference Llama rotates queries and keys as complex numbers::

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))    # (b, s, h, d/2) complex
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)                    # back to (b, s, h, d)

- ``view_as_complex``: ``(..., 2)`` float -> ``(...)`` complex. Every dim but the last (the pair
  holding real and imaginary parts) shards, to the same dim of the output.
- ``view_as_real``: ``(...)`` complex -> ``(..., 2)`` float; every dim shards, to the same dim.
- ``real``, ``imag``, ``conj``/``_conj``/``conj_physical``/``resolve_conj``, ``angle``: same shape,
  every dim shards.
- ``polar(abs, angle)`` and ``complex(real, imag)``: pointwise with broadcasting.

``P`` (summands) passes through what is real-linear: both views, ``real``, ``imag``, the
conjugates, and ``complex`` with both parts partial. ``polar`` and ``angle`` are not linear.
Complex multiplication and the other arithmetic are the ordinary pointwise rules
(``elementwise``), which accept ``P`` on complex tensors as on floating ones.
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import broadcast_placement, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
P = Partial()

__all__ = ["view_as_complex_rule", "view_as_real_rule", "complex_part_rule", "complex_pair_rule"]

_PARTIAL = Strategy1D((P,), (P,))


@register_rule(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape[:-1])] + [_PARTIAL]


@register_rule(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> list[Strategy1D]:
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(call.inputs[0].shape)] + [_PARTIAL]


_LINEAR_PARTS = {"real", "imag", "conj", "_conj", "conj_physical", "conj_physical_", "resolve_conj"}


@register_rule(aten.real.default, aten.imag.default, aten.conj.default, aten._conj.default, aten.conj_physical.default,
               aten.conj_physical_.default, aten.resolve_conj.default, aten.angle.default)
def complex_part_rule(call: OpCall) -> list[Strategy1D]:
    found = [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(call.inputs[0].shape)]
    return found + ([_PARTIAL] if call.op_name in _LINEAR_PARTS else [])


@register_rule(aten.polar.default, aten.complex.default)
def complex_pair_rule(call: OpCall) -> list[Strategy1D]:
    """Pointwise over two broadcast operands (magnitude and angle, or real and imaginary parts)."""
    out = call.outputs[0]
    k = len(out.shape)
    found = [Strategy1D(tuple(broadcast_placement(m, d, k) for m in call.inputs), (Shard(d),))
             for d in split_dims(out.shape)]
    if call.op_name == "complex" and len(call.inputs) == 2:
        found.append(Strategy1D((P, P), (P,)))
    return found
