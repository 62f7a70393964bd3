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
linear operands. Nonlinear ops never take ``P``; neither do integer or boolean tensors (every rule
of part B is registered through ``sharding_rule``, which drops such strategies).

Random ops (``dropout``, ``native_dropout``) shard freely: each rank draws its
own mask for its own piece, so the mask differs from a single-device run's (same distribution).

This module also holds the small helpers the other rule modules of part B share
(``bound_args``, ``norm_dim``, ``split_dims``, ``broadcast_placement``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import torch

from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.passes.sharding.rules.registry import OpCall, RuleFn, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = [
    "bound_args", "norm_dim", "norm_dims", "split_dims", "broadcast_placement", "pointwise_strategies",
    "floating_partials", "sharding_rule", "pointwise_rule",
]


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------

def bound_args(call: OpCall) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in (``{"self": TensorMeta, "dim": 1, ...}``)."""
    schema = getattr(call.target, "_schema", None)
    if schema is None:
        raise TypeError(f"{call.target} has no ATen schema; part-B rules only handle ATen overloads")
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(call.args) and not arg.kwarg_only:
            out[arg.name] = call.args[i]
        elif arg.name in call.kwargs:
            out[arg.name] = call.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def norm_dim(dim: int, ndim: int) -> int:
    """``-1`` -> ``ndim - 1``; a 0-dim tensor accepts dims -1 and 0 (as torch does)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % n


def norm_dims(dims: Any, ndim: int) -> list[int]:
    """A dim argument (int, list, None or ``[]``) as sorted non-negative dims; None/``[]``: all dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(int(d), ndim) for d in dims}) if ndim else []


def split_dims(shape: Sequence[int]) -> list[int]:
    """Dims worth splitting: size > 1 (a size-1 dim cannot be divided over 2+ ranks)."""
    return [d for d, s in enumerate(shape) if s > 1]


def broadcast_placement(meta: TensorMeta, out_dim: int, out_ndim: int) -> Placement:
    """Placement of a broadcasting operand when the output is split on ``out_dim``."""
    j = out_dim - (out_ndim - len(meta.shape))
    if j < 0 or meta.shape[j] == 1:
        return R
    return Shard(j)


def _floating(meta: TensorMeta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def floating_partials(call: OpCall, strategy: Strategy1D) -> bool:
    """Whether every ``P`` of ``strategy`` sits on a floating tensor (no integer or boolean summands:
    casts and comparisons of summands are not those of the sum, and only floats carry gradients)."""
    pairs = list(zip(call.inputs, strategy.inputs)) + list(zip(call.outputs, strategy.outputs))
    return all(_floating(m) for m, p in pairs if isinstance(p, Partial))


def sharding_rule(*targets) -> Callable[[RuleFn], RuleFn]:
    """``register_rule`` for the rules of this family: strategies putting ``P`` on a non-floating
    tensor are dropped, so a rule may list ``P`` options without checking dtypes."""
    def deco(fn: RuleFn) -> RuleFn:
        @functools.wraps(fn)
        def rule(call: OpCall) -> list[Strategy1D]:
            return [s for s in fn(call) if floating_partials(call, s)]
        register_rule(*targets)(rule)
        return rule
    return deco


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
    return [name for name, v in bound_args(call).items() if isinstance(v, TensorMeta)]


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
    args = bound_args(call)
    n = len(slots)
    if name in _LINEAR_UNARY and n == 1:
        return [(P,)]
    if name in ("_to_copy", "to", "type_as"):  # float->float only: sharding_rule drops the rest
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
    name = call.target._schema.name.split("::")[-1]
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


pointwise_rule = sharding_rule(*_packets(), *_OVERLOADS)(pointwise_rule)
