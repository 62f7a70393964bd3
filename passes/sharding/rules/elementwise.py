"""Sharding rules for pointwise ops (unary, binary with broadcasting, ternary, in-place variants).

A pointwise op may split any output dim ``d`` of size > 1. Operands are aligned with the output
from the right (numpy broadcasting): an operand whose dim at that position has size > 1 is split
there too (``S``); an operand whose dim there is missing or has size 1 is broadcast, so it stays
whole (``R``). Python numbers are not operands.

>>> # add(x: (4, 8), b: (8,)) -> (4, 8)
>>> # S(0): x S(0), b R        S(1): x S(1), b S(0)

Partial (``P``: each rank holds a summand) passes only through ops that are linear in the partial
operands: ``neg``, ``clone``/``contiguous``/``detach``/``alias``, dtype casts to a floating dtype,
``add``/``sub`` of two partials, ``mul`` of a partial by a replicated value, ``div`` of a partial
numerator, ``where(c, P, P)``, ``masked_fill(P, m, 0)``, ``lerp``/``addcmul``/``addcdiv`` in their
linear operands. Nonlinear ops never take ``P``; neither do integer or boolean tensors (the rule
is registered with ``float_partials_only``, which drops such strategies).

Random ops (``dropout``, ``native_dropout``) shard freely: each rank draws its
own mask for its own piece, so the mask differs from a single-device run's (same distribution).
"""
from __future__ import annotations

from typing import Iterable

import torch

from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.passes.sharding.rules.common import broadcast_placement, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["pointwise_strategies", "pointwise_rule"]


def pointwise_strategies(call: OpCall, dtype_only: Iterable[int] = ()) -> list[Strategy1D]:
    """``S(d)`` on every splittable output dim, operands broadcast-mapped; every output follows.

    ``dtype_only``: operand positions read for their dtype alone (``type_as``'s ``other``); they
    follow the output when they have its shape and stay ``R`` otherwise.
    """
    if not call.outputs:
        return []
    out = call.outputs[0]
    k = len(out.shape)
    skip = set(dtype_only)
    found = []
    for d in split_dims(out.shape):
        ins = []
        for i, m in enumerate(call.inputs):
            if i in skip:
                ins.append(Shard(d) if m.shape == out.shape else R)
            else:
                ins.append(broadcast_placement(m, d, k))
        found.append(Strategy1D(tuple(ins), tuple(Shard(d) for _ in call.outputs)))
    return found


def _tensor_slots(call: OpCall) -> list[str]:
    """Schema names of the tensor operands, in operand order (only single-tensor arguments)."""
    return [name for name, v in call.bound_args.items() if isinstance(v, TensorMeta)]


# ---------------------------------------------------------------------------------------------
# Which operand patterns give a Partial output
# ---------------------------------------------------------------------------------------------

def _pattern(slots: list[str], partial: set[str]) -> tuple[Placement, ...]:
    return tuple(P if s in partial else R for s in slots)


def _partial_patterns(call: OpCall, name: str) -> list[tuple[Placement, ...]]:
    if len(call.outputs) != 1:
        return []
    slots = _tensor_slots(call)
    if len(slots) != len(call.inputs):
        return []
    args = call.bound_args
    n = len(slots)
    if name in _LINEAR_UNARY and n == 1:
        return [(P,)]
    if name in ("_to_copy", "to", "type_as"):  # float->float only: float_partials_only drops the rest
        return [_pattern(slots, {"self"})] if slots[0] == "self" else []
    if name in ("add", "add_", "sub", "sub_", "rsub", "copy", "copy_"):
        # x + c (c a number) adds c on every rank: only sums of partials stay partial
        return [(P,) * n] if n == 2 else []
    if name in ("mul", "mul_"):
        return [(P,)] if n == 1 else [(P, R), (R, P)]
    if name in ("div", "div_"):
        if args.get("rounding_mode") is not None or slots[0] != "self":
            return []
        return [_pattern(slots, {"self"})]
    if name == "where" and slots == ["condition", "self", "other"]:
        return [(R, P, P)]
    if name in ("masked_fill", "masked_fill_") and n == 2 and args.get("value") == 0:
        return [(P, R)]
    if name in ("lerp", "lerp_"):
        return [_pattern(slots, {"self", "end"})]
    if name in ("addcmul", "addcmul_"):
        return [_pattern(slots, {"self", "tensor1"}), _pattern(slots, {"self", "tensor2"})]
    if name in ("addcdiv", "addcdiv_"):
        return [_pattern(slots, {"self", "tensor1"})]
    return []


def _broadcast_tensors_partial(call: OpCall) -> list[Strategy1D]:
    """``broadcast_tensors`` only expands: partial inputs give partial outputs."""
    n = len(call.inputs)
    return [Strategy1D((P,) * n, (P,) * n)] if len(call.outputs) == n else []


_LINEAR_UNARY = {
    "neg", "neg_", "positive", "clone", "contiguous", "detach", "detach_", "alias", "zero", "zero_",
}


def pointwise_rule(call: OpCall) -> list[Strategy1D]:
    """Rule for every op registered in this module."""
    name = call.op_name
    dtype_only = [1] if name in ("type_as",) or (name == "to" and len(call.inputs) == 2) else []
    found = pointwise_strategies(call, dtype_only=dtype_only)
    if name == "broadcast_tensors":
        return found + _broadcast_tensors_partial(call)
    for pat in _partial_patterns(call, name):
        found.append(Strategy1D(pat, tuple(P for _ in call.outputs)))
    return found


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

_UNARY = """
abs exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh asinh
acosh atanh sigmoid relu relu6 gelu silu mish softplus erf erfc erfinv reciprocal sign sgn floor ceil
round trunc frac square logical_not bitwise_not isnan isinf isfinite isneginf isposinf nan_to_num
hardtanh leaky_relu elu selu celu hardswish hardsigmoid hardshrink softshrink threshold logit
clamp clamp_min clamp_max clip neg positive clone contiguous detach alias _to_copy to type_as
dropout native_dropout fill zero pow
""".split()

_BINARY = """
add sub rsub mul div maximum minimum fmax fmin atan2 fmod remainder floor_divide eq ne lt le gt ge
logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift
bitwise_right_shift hypot copysign xlogy copy masked_fill lerp addcmul addcdiv
__and__ __or__ __xor__ __lshift__ __rshift__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__
broadcast_tensors
""".split()

# Packets with non-pointwise overloads: only the listed overloads are pointwise.
_OVERLOADS = [
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    aten.max.other, aten.min.other,
]


def _packets() -> list:
    found = []
    for name in _UNARY + _BINARY:
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is not None and packet not in found:
                found.append(packet)
    return found


pointwise_rule = register_rule(*_packets(), *_OVERLOADS, float_partials_only=True)(pointwise_rule)
