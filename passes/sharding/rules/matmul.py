"""Matmul-family rules, all derived from einsum subscripts.

For every index letter of an einsum equation there is one strategy: shard that letter wherever
it appears. An operand holding the letter is ``S(position)`` (``R`` where it broadcasts the
letter with size 1), an operand without it is ``R``; the output is ``S(position)`` if the letter
survives, else ``P`` (each rank summed only its slice of a contracted index). The op is also
linear in each operand, so one operand ``P`` with the others ``R`` gives a ``P`` output.

>>> [str(s) for s in einsum_strategies(["mk", "kn"], "mn", [(4, 6), (6, 8)])]
['(S(0), R)->(S(0))', '(S(1), S(0))->(P)', '(R, S(1))->(S(1))', '(P, R)->(P)', '(R, P)->(P)']

``addmm`` / ``baddbmm`` / ``linear`` add a broadcast addend: it follows the output (``P`` when
the output is ``P``, so the addend is counted once in the sum).

Every op here is compute-bound: its ``OpFacts`` (``passes/op_facts.py``), registered with its rule,
count its FLOPs and, for the GEMMs, name the (A, B) operands whose shape prices the kernel's
efficiency; ``mm``/``addmm``/``bmm``/``baddbmm`` are also the dispatch-level kernels whose outputs
selective checkpointing keeps (``matmul``, ``linear`` and ``einsum`` reach the device as one of them).
"""
from __future__ import annotations

from typing import Sequence

import torch

import math
import re

from autoshard.passes.op_facts import OpFacts
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten

__all__ = ["parse_einsum", "einsum_strategies", "gemm_flops", "einsum_flops"]


# ---------------------------------------------------------------- einsum machinery

def parse_einsum(equation: str, ndims: Sequence[int]) -> tuple[list[str], str]:
    """Expand an einsum equation into one subscript string per operand and one for the output.

    ``...`` becomes fresh letters, right-aligned across operands as in broadcasting; with no
    ``->`` the output is the ellipsis followed by the letters seen exactly once, sorted.

    >>> parse_einsum("...ij,jk", [3, 2])
    (['αij', 'jk'], 'αik')
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(ndims):
        raise ValueError(f"einsum {equation!r} names {len(subs)} operands but got {len(ndims)}")
    ell_len = max([nd - (len(s) - 3) for s, nd in zip(subs, ndims) if "..." in s], default=0)
    fresh = [chr(0x3B1 + i) for i in range(ell_len)]
    expanded = []
    for s, nd in zip(subs, ndims):
        if "..." in s:
            k = nd - (len(s) - 3)
            s = s.replace("...", "".join(fresh[ell_len - k:]))
        if len(s) != nd:
            raise ValueError(f"einsum {equation!r}: subscript {s!r} does not match an operand with {nd} dims")
        expanded.append(s)
    if arrow:
        out = rhs.replace("...", "".join(fresh))
    else:
        counts: dict[str, int] = {}
        for s in expanded:
            for c in s:
                counts[c] = counts.get(c, 0) + 1
        out = "".join(fresh) + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in fresh))
    return expanded, out


def einsum_strategies(inputs: Sequence[str], output: str, shapes: Sequence[Sequence[int]],
                      partial_operands: bool = True) -> list[Strategy1D]:
    """One strategy per shardable index letter, then (optionally) one per ``P`` operand.

    ``inputs``: expanded subscripts (see ``parse_einsum``); ``shapes``: one shape per operand.
    A letter is skipped when its size is 1 everywhere or it repeats inside one subscript
    (a diagonal cannot be split along one dim).
    """
    sizes: dict[str, int] = {}
    for sub, shape in zip(inputs, shapes):
        for c, n in zip(sub, shape):
            sizes[c] = max(sizes.get(c, 1), int(n))
    out: list[Strategy1D] = []
    for letter in dict.fromkeys("".join(inputs)):
        if sizes[letter] <= 1 or any(s.count(letter) > 1 for s in (*inputs, output)):
            continue
        placements: list[Placement] = []
        for sub, shape in zip(inputs, shapes):
            pos = sub.find(letter)
            placements.append(Shard(pos) if pos >= 0 and shape[pos] == sizes[letter] else Replicate())
        result = Shard(output.index(letter)) if letter in output else Partial()
        out.append(Strategy1D(tuple(placements), (result,)))
    if partial_operands:
        for i in range(len(inputs)):
            pls = tuple(Partial() if j == i else Replicate() for j in range(len(inputs)))
            out.append(Strategy1D(pls, (Partial(),)))
    return out


def _addend(p: Placement, addend: Sequence[int], out: Sequence[int]) -> Placement:
    """Placement of a broadcast addend given the output's placement."""
    if isinstance(p, Shard):
        d = p.dim - (len(out) - len(addend))
        return Shard(d) if d >= 0 and addend[d] == out[p.dim] else Replicate()
    return p


def _with_addend(strategies: list[Strategy1D], addend: TensorMeta, out: TensorMeta,
                 first: bool) -> list[Strategy1D]:
    res = []
    for s in strategies:
        a = _addend(s.outputs[0], addend.shape, out.shape)
        ins = (a, *s.inputs) if first else (*s.inputs, a)
        res.append(Strategy1D(ins, s.outputs))
    return res


# ---------------------------------------------------------------- rules

def _fixed(subs: list[str], out: str):
    def rule(call: OpCall) -> list[Strategy1D]:
        return einsum_strategies(subs, out, [m.shape for m in call.inputs])
    return rule


# ---------------------------------------------------------------- op facts

def gemm_flops(a: int = 0):
    """FLOPs of a GEMM whose left operand is operand ``a``: 2 * output elements * K (K: ``a``'s last dim)."""
    def flops(call: OpCall) -> float:
        x = call.inputs[a]
        return 2.0 * call.outputs[0].numel * (x.shape[-1] if x.shape else 1)
    return flops


def einsum_flops(call: OpCall):
    """2 * the product of every index letter's size (None when the equation is not a literal string)."""
    eq = call.args[0] if isinstance(call.args[0], str) else None
    if eq is None:
        return None
    sizes: dict[str, int] = {}
    for term, meta in zip(eq.split("->")[0].split(","), call.inputs):
        letters = re.sub(r"[^a-zA-Z]", "", term)
        for ch, s in zip(letters, meta.shape[-len(letters):] if letters else ()):
            sizes[ch] = s
    return 2.0 * math.prod(sizes.values())


_GEMM = OpFacts(flops=gemm_flops(0), gemm_operands=(0, 1))
_GEMM_KERNEL = OpFacts(flops=gemm_flops(0), gemm_operands=(0, 1), selective_save=True)
#: ``self + m1 @ m2``: the matrices are operands 1 and 2, the addend (a sum's gradient) operand 0
_ADDMM_KERNEL = OpFacts(flops=gemm_flops(1), gemm_operands=(1, 2), grad_operands=(1, 2), bias_operand=0,
                        selective_save=True)

register_rule(aten.mm.default, facts=_GEMM_KERNEL)(_fixed(["mk", "kn"], "mn"))
register_rule(aten.bmm.default, facts=_GEMM_KERNEL)(_fixed(["bmk", "bkn"], "bmn"))


@register_rule(aten.addmm.default, aten.baddbmm.default, facts=_ADDMM_KERNEL)
def addmm_rule(call: OpCall) -> list[Strategy1D]:
    """``beta * self + alpha * (m1 @ m2)``: mm/bmm strategies, ``self`` following the output."""
    addend, a, b = call.inputs
    subs, out = (["mk", "kn"], "mn") if len(a.shape) == 2 else (["bmk", "bkn"], "bmn")
    return _with_addend(einsum_strategies(subs, out, [a.shape, b.shape]), addend, call.outputs[0], first=True)


def _matmul_subscripts(na: int, nb: int) -> str:
    left = "k" if na == 1 else "...mk"
    right = "k" if nb == 1 else "...kn"
    out = "..." + ("m" if na > 1 else "") + ("n" if nb > 1 else "")
    return f"{left},{right}->{out}"


@register_rule(aten.matmul.default, facts=_GEMM)
def matmul_rule(call: OpCall) -> list[Strategy1D]:
    a, b = call.inputs
    subs, out = parse_einsum(_matmul_subscripts(len(a.shape), len(b.shape)), [len(a.shape), len(b.shape)])
    return einsum_strategies(subs, out, [a.shape, b.shape])


@register_rule(aten.linear.default, facts=_GEMM)
def linear_rule(call: OpCall) -> list[Strategy1D]:
    """``x @ w.T + b`` with x ``(..., k)``, w ``(n, k)``, optional b broadcast to ``(..., n)``."""
    x, w = call.inputs[:2]
    subs, out = parse_einsum("...k,nk->...n", [len(x.shape), len(w.shape)])
    found = einsum_strategies(subs, out, [x.shape, w.shape])
    if len(call.inputs) == 3:
        found = _with_addend(found, call.inputs[2], call.outputs[0], first=False)
    return found


@register_rule(aten.einsum.default, facts=OpFacts(flops=einsum_flops))
def einsum_rule(call: OpCall) -> list[Strategy1D]:
    equation = call.bound_args["equation"]
    subs, out = parse_einsum(equation, [len(m.shape) for m in call.inputs])
    return einsum_strategies(subs, out, [m.shape for m in call.inputs])

