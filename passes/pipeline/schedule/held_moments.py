"""How many microbatches each stage of a rank holds at every moment of a schedule, as data.

A rank running several stages (interleaved 1F1B, ZBV, DualPipeV) runs one of them at a time. Its
memory at a moment is what every stage it owns keeps (parameters, gradients, optimizer state, the
saved activations of the microbatches it holds then) plus the working set of the one stage that
runs. ``held_moments(schedule, p, m)`` lists those moments per rank: at each compute action of the
rank's order (``Schedule.order``, the order the runtime runs), the stage that runs and how many
microbatches each of the rank's stages holds (a microbatch is held from its ``F`` to its ``W`` or
``BW``, as ``simulate.in_flight_peaks`` counts: at an ``F`` the new microbatch counts, at a
backward the one being back-propagated still does). Moments whose counts another moment of the same
running stage meets or exceeds on every stage are dropped: no memory can peak there (the rest come
per running stage in the order first run, largest total first).

>>> held_moments("1f1b", 2, 4)[0]
((0, ((0, 2),)),)
>>> [m for m in held_moments("interleaved-1f1b", 2, 4)[0] if m[0] == 0]
[(0, ((0, 3), (2, 2))), (0, ((0, 4), (2, 1)))]

Summing each stage's own worst count instead counts 6 microbatches on rank 0 there (stage 0 holds 4
at one moment, stage 2 holds 2 at another); the rank never holds more than 5 at once.
"""
from __future__ import annotations

import functools

from autoshard.passes.pipeline.schedule.registry import get_schedule

__all__ = ["held_moments", "Moment"]

#: (running stage, ((stage, microbatches held), ...) over the rank's stages in stage order)
Moment = tuple


@functools.lru_cache(maxsize=256)
def held_moments(schedule: str, p: int, m: int) -> tuple[tuple[Moment, ...], ...]:
    """Per rank 0..p-1, its moments (module docstring): the undominated ones."""
    desc = get_schedule(schedule)
    problem = desc.problem(p, m)
    if problem:
        raise ValueError(problem)
    owner = desc.stage_rank(p)
    order = desc.order(p, m, desc.virtual_stages)
    out = []
    for rank in range(p):
        mine = [s for s, r in enumerate(owner) if r == rank]
        held = dict.fromkeys(mine, 0)
        seen: dict[int, list[tuple]] = {}
        for a in order.get(rank, []):
            if a.kind not in ("F", "B", "W", "BW"):
                continue
            if a.kind == "F":
                held[a.stage] += 1
            seen.setdefault(a.stage, []).append(tuple(held[s] for s in mine))
            if a.kind in ("W", "BW"):
                held[a.stage] -= 1
        moments = []
        for stage, counts in seen.items():
            for k in _undominated(counts):
                moments.append((stage, tuple(zip(mine, k))))
        out.append(tuple(moments))
    return tuple(out)


def _undominated(vectors: list[tuple]) -> list[tuple]:
    """The distinct vectors no other one meets or exceeds on every entry, largest total first (a
    vector's dominator has a larger total, so it is kept, or dominated by a kept one, before it)."""
    kept: list[tuple] = []
    for v in sorted(set(vectors), key=lambda v: (-sum(v), v)):
        if not any(all(b >= a for a, b in zip(v, w)) for w in kept):
            kept.append(v)
    return kept
