"""The steps that take a tensor from one placement to another: what the runtime runs and the cost
model prices, computed here once.

Placements travel as integer codes (``encode``): ``S(d)`` -> d, ``R`` -> ``R_CODE``, ``P`` -> ``P_CODE``.
``redistribution_steps(src, dst, mesh_shape)`` (codes) and ``plan_redistribute`` (placements) return
``Step``s, one collective or local op on one mesh axis each, in this order (correct under DTensor's
left-to-right nesting of shards on the same dim):

1. Unshard, from the last axis to the first: an axis whose placement changes gives up its shard
   (S(d) -> R: all-gather; P -> R: all-reduce). A shard an axis keeps is given up as well when an
   earlier axis changes how the same dim is split (its chunk would nest in the wrong parent).
   S(i) -> S(j) becomes one all-to-all when no other axis touches dims i or j except earlier
   axes that keep their placement.
2. Shard, from the first axis to the last: R -> S(d) is a local chunk, P -> S(d) a
   reduce-scatter, R -> P keeps the value on coordinate 0 and zeros elsewhere (``to_partial``).

Axes of size 1 are skipped (every placement means the same there).

>>> redistribution_steps((0, 0), (-1, -1), (2, 2))         # FSDP weight (S(0), S(0)) -> (R, R)
[Step('all_gather', 1, 0), Step('all_gather', 0, 0)]
>>> redistribution_steps((0, 0), (1, 0), (2, 2))           # nested shards: no all-to-all
[Step('all_gather', 1, 0), Step('all_gather', 0, 0), Step('chunk', 0, 1), Step('chunk', 1, 0)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from autoshard.passes.layout.shapes import normalize
from autoshard.passes.spec import Partial, Placement, Replicate, Shard

__all__ = ["R_CODE", "P_CODE", "placement_code", "encode", "Step", "COMMUNICATING", "redistribution_steps",
           "plan_redistribute"]

#: placement codes: ``S(d)`` is ``d >= 0``
R_CODE, P_CODE = -1, -2

#: the step kinds that talk to other ranks (``chunk`` and ``to_partial`` are local)
COMMUNICATING = frozenset({"all_gather", "all_reduce", "all_to_all", "reduce_scatter"})


def placement_code(p: Placement) -> int:
    """``S(d)`` -> d, ``R`` -> -1, ``P`` -> -2 (exact type checks first: placement isinstance is slow)."""
    t = type(p)
    if t is Replicate:
        return R_CODE
    if t is Shard:
        return p.dim
    if t is Partial:
        return P_CODE
    if isinstance(p, Shard):
        return p.dim
    return P_CODE if isinstance(p, Partial) else R_CODE


def encode(pls: Sequence[Placement]) -> tuple[int, ...]:
    """
    >>> from autoshard.passes.spec import P, R, S
    >>> encode((S(0), R, P))
    (0, -1, -2)
    """
    return tuple(placement_code(p) for p in pls)


@dataclass(frozen=True)
class Step:
    """One collective or local op: ``kind`` (all_gather, all_reduce, all_to_all, reduce_scatter,
    chunk, to_partial) on mesh ``axis``. ``dim``: the tensor dim it gathers/splits (for all_to_all
    the gathered dim); ``dim2``: the dim all_to_all splits."""
    kind: str
    axis: int
    dim: Optional[int] = None
    dim2: Optional[int] = None

    def __repr__(self) -> str:
        extra = "".join(f", {d}" for d in (self.dim, self.dim2) if d is not None)
        return f"Step({self.kind!r}, {self.axis}{extra})"


def redistribution_steps(src: Sequence[int], dst: Sequence[int], mesh_shape: Sequence[int]) -> list[Step]:
    """The steps from placement codes ``src`` to ``dst`` (dims non-negative) on a mesh of
    ``mesh_shape``, in the order of the module docstring."""
    src = tuple(R_CODE if n == 1 else c for c, n in zip(src, mesh_shape))
    dst = tuple(R_CODE if n == 1 else c for c, n in zip(dst, mesh_shape))
    if src == dst:
        return []
    nax = len(src)
    changed = [src[a] != dst[a] for a in range(nax)]

    def relation_changes_before(b: int, d: int) -> bool:
        return any(changed[a] and d in (src[a], dst[a]) for a in range(b))

    def can_exchange(b: int, i: int, j: int) -> bool:
        return not any(c != b and (src[c] in (i, j) or dst[c] in (i, j)) and (c > b or changed[c])
                       for c in range(nax))

    steps: list[Step] = []
    cur = list(src)
    for b in reversed(range(nax)):
        p, q = cur[b], dst[b]
        if p >= 0:
            if p == q and not relation_changes_before(b, p):
                continue
            if q >= 0 and q != p and can_exchange(b, p, q):
                steps.append(Step("all_to_all", b, p, q))
                cur[b] = q
            else:
                steps.append(Step("all_gather", b, p))
                cur[b] = R_CODE
        elif p == P_CODE and q == R_CODE:
            steps.append(Step("all_reduce", b))
            cur[b] = q
    for a in range(nax):
        p, q = cur[a], dst[a]
        if p == q:
            continue
        if q >= 0:
            steps.append(Step("chunk" if p == R_CODE else "reduce_scatter", a, q))
        elif q == P_CODE:
            steps.append(Step("to_partial", a))
        else:  # pragma: no cover - phase 1 leaves no S or P that must become R
            raise AssertionError(f"redistribution left code {p} on axis {a} for target code {q}")
        cur[a] = q
    return steps


def plan_redistribute(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int],
                      ndim: Optional[int] = None) -> list[Step]:
    """``redistribution_steps`` for placements: size-1 axes made ``R``, a negative ``S(d)`` counted
    from the last of ``ndim`` dims (default: one more than the largest dim named).

    >>> from autoshard.passes.spec import R, S
    >>> plan_redistribute((S(0), S(0)), (R, S(0)), (2, 2))
    [Step('all_gather', 1, 0), Step('all_gather', 0, 0), Step('chunk', 1, 0)]
    """
    src = normalize(src, mesh_shape)
    dst = normalize(dst, mesh_shape)
    if src == dst:
        return []
    if ndim is None:
        ndim = 1 + max([p.dim for p in src + dst if isinstance(p, Shard)], default=0)

    def code(p: Placement) -> int:
        return p.dim % ndim if isinstance(p, Shard) and ndim else placement_code(p)

    return redistribution_steps(tuple(code(p) for p in src), tuple(code(p) for p in dst), mesh_shape)
