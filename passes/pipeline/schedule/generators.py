"""Pipeline schedules as action lists: ``generate(name, p, m) -> dict[rank, list[Action]]``.

``generate`` looks the schedule up in ``registry.py`` (its stage placement, virtual stages and
validity), takes its compute order from ``orders.py`` (where every schedule's order is described,
with the step times it achieves) and adds a SEND/RECV pair for every cross-rank transfer
(``with_comms``). ``stage_rank`` says which rank owns each stage; ``prepared`` memoises
``prepare(generate(...))`` for callers (the stage planner) that time one schedule under many costs.

>>> sched = generate("1f1b", 2, 2)
>>> [str(a) for a in sched[0]]
['0F0', '0SEND_F0->1', '0F1', '0SEND_F1->1', '0RECV_B0<-1', '0BW0', '0RECV_B1<-1', '0BW1']
>>> stage_rank("zbv", 2), stage_rank("interleaved-1f1b", 2), stage_rank("interleaved-1f1b-v3", 2)
([0, 1, 1, 0], [0, 1, 0, 1], [0, 1, 0, 1, 0, 1])
"""
from __future__ import annotations

import functools
from typing import Optional

from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.registry import get_schedule, schedule_names
from autoshard.passes.pipeline.schedule.simulate import (PreparedSchedule, ScheduleError, StageCosts, in_flight_peaks,
                                                         prepare, simulate)

__all__ = ["SCHEDULE_NAMES", "generate", "held_per_stage", "prepared", "stage_rank", "with_comms"]

#: the registered schedule names (``interleaved-1f1b-v<N>`` for other N is accepted too)
SCHEDULE_NAMES = schedule_names()


def stage_rank(schedule: str, p: int, v: Optional[int] = None) -> list[int]:
    """Rank owning each stage of ``schedule`` on p ranks: round-robin ``s % p`` or a V (registry).
    ``v``, if given, must be the schedule's stages per rank."""
    return get_schedule(schedule).stage_rank(p) if v is None else _checked(schedule, v).stage_rank(p)


def generate(schedule: str, n_stages_physical: int, n_microbatches: int, virtual: Optional[int] = None
             ) -> dict[int, list[Action]]:
    """Per-rank action lists for ``schedule`` on p = ``n_stages_physical`` ranks and m microbatches.

    ``virtual`` (stages per rank) defaults to the schedule's own (``interleaved-1f1b-v3``: 3); if
    given it must equal it. The result passes ``check_deadlock`` (also with blocking sends).
    """
    return _generated(schedule, n_stages_physical, n_microbatches, virtual)[0]


def _generated(schedule: str, p: int, m: int, virtual: Optional[int]
               ) -> tuple[dict[int, list[Action]], list[tuple[int, int]]]:
    """``generate``'s schedule and the global sequence it was read off (``_ordered_with_comms``)."""
    desc = get_schedule(schedule) if virtual is None else _checked(schedule, virtual)
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ScheduleError(f"need integers p >= 1, m >= 1; got p={p}, m={m}")
    problem = desc.problem(p, m)
    if problem:
        raise ScheduleError(problem)
    return _ordered_with_comms(desc.order(p, m, desc.virtual_stages), desc.stage_rank(p))


@functools.lru_cache(maxsize=1024)
def held_per_stage(schedule: str, n_stages_physical: int, n_microbatches: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once: what
    ``prepared(schedule, p, m).peak_stage`` says, counted on the compute order alone (the transfers
    ``with_comms`` adds change no count), without building, validating and compiling the schedule
    with its transfers, which takes most of a second on GPT-3 175B's p = 16, m = 1536 / 16."""
    p, m = n_stages_physical, n_microbatches
    desc = get_schedule(schedule)
    problem = desc.problem(p, m)
    if problem:
        raise ScheduleError(problem)
    return tuple(in_flight_peaks(desc.order(p, m, desc.virtual_stages), p * desc.virtual_stages)[0])


@functools.lru_cache(maxsize=512)
def prepared(schedule: str, n_stages_physical: int, n_microbatches: int, virtual: Optional[int] = None
             ) -> PreparedSchedule:
    """``prepare(generate(...))``, memoised: time a generated schedule under many costs cheaply.

    ``simulate(prepared("1f1b", 8, 32), costs)`` costs a few ms against tens of ms for
    ``simulate(generate(...), costs)``; the result is shared, so treat it as read-only. The global
    sequence ``with_comms`` built is handed to ``prepare`` as the completion order, which it checks
    in one pass instead of dry-running the schedule a second time.
    """
    return prepare(*_generated(schedule, n_stages_physical, n_microbatches, virtual))


def _checked(schedule: str, virtual: int):
    desc = get_schedule(schedule)
    if virtual != desc.virtual_stages:
        count = "one stage" if desc.virtual_stages == 1 else f"exactly {desc.virtual_stages} stages"
        other = (f"; for {virtual} stages per rank use 'interleaved-1f1b-v{virtual}'"
                 if isinstance(virtual, int) and virtual >= 2 else "")
        raise ScheduleError(f"{desc.name} runs {count} per rank; got virtual={virtual}{other}")
    return desc


def with_comms(compute: dict[int, list[Action]], owner: list[int]) -> dict[int, list[Action]]:
    """Add SEND/RECV pairs by projecting one global order of events onto every rank.

    Runs the compute-only schedule at unit costs, then orders every compute action by its start and
    every transfer at the moment its producer ends (just before anything starting then). Because all
    ranks read their lists off this single sequence, a transfer sits between its producer and its
    consumer on both sides and all ranks agree on the order of transfers, so the schedule completes
    even if every send blocks until its receive (the proof: run the global sequence in order).
    """
    return _ordered_with_comms(compute, owner)[0]


def _ordered_with_comms(compute: dict[int, list[Action]], owner: list[int]
                        ) -> tuple[dict[int, list[Action]], list[tuple[int, int]]]:
    """``with_comms`` and its global sequence, as (rank, index in that rank's list)."""
    n = len(owner)
    try:
        timed = simulate(compute, StageCosts(1.0, 1.0, 1.0))
    except ScheduleError as err:
        raise ScheduleError(f"internal error: a generated compute order is invalid: {err}") from err
    seq = []
    position: dict[int, int] = {}
    for r, a, start, end in timed.events:
        idx = position[r] = position.get(r, -1) + 1
        seq.append((start, 1, r, idx, [(r, a)]))
        s, i = a.stage, a.microbatch
        if a.kind == "F" and s + 1 < n and owner[s + 1] != r:
            dst = owner[s + 1]
            seq.append((end, 0, r, idx, [(r, Action(s, "SEND_F", i, s + 1)),
                                         (dst, Action(s + 1, "RECV_F", i, s))]))
        if a.kind in ("B", "BW") and s > 0 and owner[s - 1] != r:
            dst = owner[s - 1]
            seq.append((end, 0, r, idx, [(r, Action(s, "SEND_B", i, s - 1)),
                                         (dst, Action(s - 1, "RECV_B", i, s))]))
    seq.sort()  # (time, kind, rank, index) never ties, so the lists are never compared
    out: dict[int, list[Action]] = {r: [] for r in compute}
    order = []
    for *_, items in seq:
        for r, a in items:
            order.append((r, len(out[r])))
            out[r].append(a)
    return out, order
