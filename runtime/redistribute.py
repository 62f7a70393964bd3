"""Turn a tensor placed one way into the same tensor placed another way.

``plan_redistribute(src, dst, mesh_shape)`` returns the list of ``Step``s (one collective on one
mesh axis each); ``redistribute`` runs them eagerly; the lowering pass emits the same steps as
calls in the per-rank program.

Order (correct under DTensor's left-to-right nesting of shards on the same dim):

1. Unshard, from the last axis to the first: an axis whose placement changes gives up its shard
   (S(d) -> R: all-gather; P -> R: all-reduce). A shard an axis keeps is given up as well when an
   earlier axis changes how the same dim is split (its chunk would nest in the wrong parent).
   S(i) -> S(j) becomes one all-to-all when no other axis touches dims i or j except earlier
   axes that keep their placement.
2. Shard, from the first axis to the last: R -> S(d) is a local chunk, P -> S(d) a
   reduce-scatter, R -> P keeps the value on coordinate 0 and zeros elsewhere.

Axes of size 1 are skipped (every placement means the same there).

>>> plan_redistribute((S(0), S(0)), (R, S(0)), (2, 2))
[Step('all_gather', 1, 0), Step('all_gather', 0, 0), Step('chunk', 1, 0)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from autoshard.passes.spec import Partial, Placement, Replicate, Shard

from . import collectives as C
from .layout import normalize

__all__ = ["Step", "plan_redistribute", "step_call", "redistribute"]


@dataclass(frozen=True)
class Step:
    """One collective: ``kind`` (a name in ``collectives.COLLECTIVES``) on mesh ``axis``.

    ``dim``: the tensor dim it gathers/splits (for all_to_all the gathered dim); ``dim2``: the
    dim all_to_all splits.
    """
    kind: str
    axis: int
    dim: Optional[int] = None
    dim2: Optional[int] = None

    def __repr__(self) -> str:
        extra = "".join(f", {d}" for d in (self.dim, self.dim2) if d is not None)
        return f"Step({self.kind!r}, {self.axis}{extra})"


def _dim(p: Placement, ndim: int) -> Optional[int]:
    return p.dim % ndim if isinstance(p, Shard) and ndim else (p.dim if isinstance(p, Shard) else None)


def plan_redistribute(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int],
                      ndim: Optional[int] = None) -> list[Step]:
    """The steps taking placements ``src`` to ``dst`` (see the module docstring for the order)."""
    src = normalize(src, mesh_shape)
    dst = normalize(dst, mesh_shape)
    if src == dst:
        return []
    if ndim is None:
        ndim = 1 + max([p.dim for p in src + dst if isinstance(p, Shard)], default=0)
    src = tuple(Shard(_dim(p, ndim)) if isinstance(p, Shard) else p for p in src)
    dst = tuple(Shard(_dim(p, ndim)) if isinstance(p, Shard) else p for p in dst)
    n = len(src)
    changed = [src[a] != dst[a] for a in range(n)]

    def relation_changes_before(b: int, d: int) -> bool:
        return any(changed[a] and (src[a] == Shard(d) or dst[a] == Shard(d)) for a in range(b))

    def can_exchange(b: int, i: int, j: int) -> bool:
        for c in range(n):
            if c != b and (src[c] in (Shard(i), Shard(j)) or dst[c] in (Shard(i), Shard(j))):
                if c > b or changed[c]:
                    return False
        return True

    steps: list[Step] = []
    cur = list(src)
    for b in reversed(range(n)):
        p, q = cur[b], dst[b]
        if isinstance(p, Shard):
            if p == q and not relation_changes_before(b, p.dim):
                continue
            if isinstance(q, Shard) and q != p and can_exchange(b, p.dim, q.dim):
                steps.append(Step("all_to_all", b, p.dim, q.dim))
                cur[b] = q
            else:
                steps.append(Step("all_gather", b, p.dim))
                cur[b] = Replicate()
        elif isinstance(p, Partial) and isinstance(q, Replicate):
            steps.append(Step("all_reduce", b))
            cur[b] = q
    for a in range(n):
        p, q = cur[a], dst[a]
        if p == q:
            continue
        if isinstance(q, Shard):
            steps.append(Step("chunk" if isinstance(p, Replicate) else "reduce_scatter", a, q.dim))
        elif isinstance(q, Partial):
            steps.append(Step("to_partial", a))
        else:  # pragma: no cover - phase 1 leaves no S or P that must become R
            raise AssertionError(f"redistribution left {p} on axis {a} for target {q}")
        cur[a] = q
    return steps


def step_call(step: Step) -> tuple[Callable, tuple]:
    """The collective function and its static arguments (the comm is appended by the caller)."""
    fn = C.COLLECTIVES[step.kind]
    if step.kind in ("all_gather", "reduce_scatter", "chunk"):
        return fn, (step.dim,)
    if step.kind == "all_to_all":
        return fn, (step.dim, step.dim2)
    return fn, ()


def redistribute(x: torch.Tensor, src: Sequence[Placement], dst: Sequence[Placement], env) -> torch.Tensor:
    """Run the steps eagerly (autograd-aware). ``env``: a ``MeshEnv``."""
    for step in plan_redistribute(src, dst, env.mesh.shape, x.dim()):
        fn, args = step_call(step)
        x = fn(x, *args, env.comm(step.axis))
    return x
