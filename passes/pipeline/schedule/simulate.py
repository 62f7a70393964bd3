"""Time a pipeline schedule: step time, bubble and activation memory (its validity: ``dry_run.py``).

A schedule is ``dict[rank, list[Action]]`` (see ``actions.py``); which action may run when, and how
SEND/RECV match, is ``dry_run.py``'s. For timing, a ``RECV_*`` ends when the matching send was posted
plus ``latency``; a ``SEND_*`` takes no time on the compute stream.

Costs: ``StageCosts(f, b, w, latency)`` with scalars or per-stage lists; ``BW = B + W``. A compute
dependency crossing ranks pays ``latency`` even when the schedule carries no SEND/RECV actions, so
the planner may simulate compute-only schedules.

>>> from autoshard.passes.pipeline.schedule.actions import Action
>>> sched = {0: [Action(0, "F", 0), Action(0, "SEND_F", 0, 1), Action(0, "RECV_B", 0, 1), Action(0, "BW", 0)],
...          1: [Action(1, "RECV_F", 0, 0), Action(1, "F", 0), Action(1, "BW", 0), Action(1, "SEND_B", 0, 0)]}
>>> r = simulate(sched, StageCosts(f=1, b=1, w=1))
>>> r.step_time, r.busy, round(r.bubble_fraction, 3)
(6.0, [3.0, 3.0], 0.5)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS, Action
from autoshard.passes.pipeline.schedule.dry_run import (DeadlockError, ScheduleError, check_complete, check_deadlock,
                                                       compute_deps, dry_run, incomplete_pairs, input_key,
                                                       stage_owners, transfer_key)

#: the errors and ``check_deadlock`` live in ``dry_run`` and are importable from here as before
__all__ = ["ScheduleError", "DeadlockError", "check_deadlock", "StageCosts", "SimResult", "PreparedSchedule", "prepare",
           "in_flight_peaks", "simulate"]

Number = Union[int, float]


@dataclass(frozen=True)
class StageCosts:
    """Durations per stage (a scalar applies to every stage) and the latency of one cross-rank transfer."""
    f: Union[Number, Sequence[Number]] = 1.0
    b: Union[Number, Sequence[Number]] = 1.0
    w: Union[Number, Sequence[Number]] = 1.0
    latency: float = 0.0

    def table(self, n_stages: int) -> dict[str, list[float]]:
        """``{"F": [...], "B": [...], "W": [...], "BW": [...]}``, one duration per stage."""
        out = {}
        for kind, val in (("F", self.f), ("B", self.b), ("W", self.w)):
            if isinstance(val, (int, float)):
                out[kind] = [float(val)] * n_stages
            else:
                if len(val) != n_stages:
                    raise ScheduleError(f"StageCosts.{kind.lower()} has {len(val)} entries but the schedule has "
                                        f"{n_stages} stages; give one duration per stage or a scalar")
                out[kind] = [float(x) for x in val]
        out["BW"] = [b + w for b, w in zip(out["B"], out["W"])]
        return out


@dataclass
class SimResult:
    """What a dry run found. ``events``: ``(rank, action, start, end)`` for every action, in rank order.

    ``bubble_fraction = 1 - sum(busy) / (ranks * step_time)``; an activation is held from the start of
    its ``F`` until its ``W`` or ``BW`` ends, and ``peak_stage``/``peak_rank`` count the most
    microbatches held at once.
    """
    step_time: float
    busy: list[float]
    bubble_fraction: float
    peak_stage: list[int]
    peak_rank: list[int]
    events: list[tuple[int, Action, float, float]] = field(default_factory=list)

    def trace_events(self) -> list[tuple[int, str, float, float, Optional[int]]]:
        """Compute events as ``(rank, label, start, end, microbatch)`` for ``timeline.chrome_trace``."""
        return [(r, str(a), s, e, a.microbatch) for r, a, s, e in self.events if a.kind in ("F", "B", "W", "BW")]


@dataclass(frozen=True)
class PreparedSchedule:
    """A validated schedule compiled to a dependency DAG, for timing it under many costs quickly.

    ``actions``: (rank, Action), rank-major; ``order``: a topological order of their indices;
    ``prev``: index of the previous action on the same rank (-1 for the first); ``deps``: (index,
    crosses ranks) per action. Memory peaks depend only on the order, so they are computed here.
    """
    n_stages: int
    ranks: list[int]
    actions: list[tuple[int, Action]]
    order: list[int]
    prev: list[int]
    deps: list[tuple[tuple[int, bool], ...]]
    peak_stage: list[int]
    peak_rank: list[int]


def prepare(schedule: dict, order: Optional[Sequence[tuple[int, int]]] = None) -> PreparedSchedule:
    """Validate ``schedule`` (DeadlockError/ScheduleError as ``simulate``) and compile it for timing.

    ``order``, if given, claims a completion order of the whole schedule as (rank, index in its list),
    e.g. the global sequence ``generators.with_comms`` builds: it is then checked in one linear pass
    (a permutation, each rank's list in order, every dependency, payload, SEND and input RECV earlier,
    transfers matching FIFO per rank pair, every compute action once) instead of dry-running the
    schedule. A claim that fails any check is dropped for the full dry run, which raises its errors.
    """
    n_stages, owner = stage_owners(schedule)
    flat, base = _flatten(schedule)
    where, sends, recvs, unique = _tables(flat)
    if order is not None and unique:
        try:
            prev, deps = _edges(flat, base, owner, n_stages, where, sends)
        except KeyError:  # a dependency no rank runs: the dry run says which
            prev = deps = None
        if deps is not None and _order_holds(flat, base, order, owner, n_stages, where, sends, recvs, deps):
            return _compiled(schedule, n_stages, flat, base, prev, deps, order)
    has_comms = len(sends) + len(recvs) > 0
    run_order, done, stuck, n_stages, owner = dry_run(schedule, comms="eager", need_recv=has_comms)
    if stuck:
        raise DeadlockError("schedule deadlocks; first stuck action per rank:\n" + "\n".join(stuck))
    check_complete(schedule, done, n_stages)
    prev, deps = _edges(flat, base, owner, n_stages, where, sends)
    return _compiled(schedule, n_stages, flat, base, prev, deps, run_order)


def _flatten(schedule: dict) -> tuple[list[tuple[int, Action]], dict[int, int]]:
    """(rank, action) rank-major, and the index of each rank's first action."""
    base, flat = {}, []
    for r in sorted(schedule):
        base[r] = len(flat)
        flat += [(r, a) for a in schedule[r]]
    return flat, base


def _tables(flat: list) -> tuple[dict, dict, dict, bool]:
    """Index of every compute key (("G" also: input grad of the stage), SEND and (rank, RECV) key
    (the last of a repeat), and whether none repeats."""
    where, sends, recvs = {}, {}, {}
    unique = True
    for g, (r, a) in enumerate(flat):
        k = a.kind
        if k in COMPUTE_KINDS:
            key = (a.stage, k, a.microbatch)
            unique = unique and key not in where
            where[key] = g
            if k == "B" or k == "BW":
                where[(a.stage, "G", a.microbatch)] = g
        elif k[0] == "S":
            key = transfer_key(a)
            unique = unique and key not in sends
            sends[key] = g
        else:
            key = (r, transfer_key(a))
            unique = unique and key not in recvs
            recvs[key] = g
    return where, sends, recvs, unique


def _edges(flat, base, owner, n_stages, where, sends) -> tuple[list[int], list[tuple]]:
    """``PreparedSchedule.prev`` and ``.deps``; KeyError when a dependency is missing."""
    prev, deps = [], []
    for g, (r, a) in enumerate(flat):
        prev.append(g - 1 if g > base[r] else -1)
        k = a.kind
        if k in COMPUTE_KINDS:
            deps.append(tuple((where[d], owner[d[0]] != r) for d in compute_deps(a, n_stages)))
        elif k[0] == "R":
            deps.append(((sends[transfer_key(a)], True),))
        else:
            deps.append(())
    return prev, deps


def _order_holds(flat, base, order, owner, n_stages, where, sends, recvs, deps) -> bool:
    """Whether ``order`` is a completion order the eager dry run (``need_recv`` when the schedule
    carries transfers) would accept, with every compute action present: see ``prepare``."""
    n = len(flat)
    if len(order) != n:
        return False
    need_recv = bool(sends or recvs)
    done = bytearray(n)
    channels: dict[tuple, list] = {}
    try:
        for r, i in order:
            g = base[r] + i
            if i < 0 or g >= n or done[g] or flat[g][0] != r or (i > 0 and not done[g - 1]):
                return False
            for d, cross in deps[g]:
                if not done[d]:
                    return False
            a = flat[g][1]
            k = a.kind
            if k in COMPUTE_KINDS:
                if need_recv:
                    for d, cross in deps[g]:
                        if cross:
                            rv = recvs.get((r, input_key(_key_of(flat[d][1]), a.stage)))
                            if rv is None or not done[rv]:
                                return False
            else:
                peer = owner[a.peer]
                key = transfer_key(a)
                if k[0] == "S":
                    payload = where.get((a.stage, "F" if k == "SEND_F" else "G", a.microbatch))
                    if payload is None or not done[payload]:
                        return False
                    channels.setdefault((r, peer, "S"), []).append(key)
                else:
                    channels.setdefault((peer, r, "R"), []).append(key)
            done[g] = 1
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    for (src, dst, side), keys in channels.items():
        if channels.get((src, dst, "R" if side == "S" else "S")) != keys:
            return False
    return not incomplete_pairs(flat, where, n_stages)


def _key_of(producer: Action) -> tuple:
    """The dependency key a compute action satisfies for its consumer (B/BW: the input grad "G")."""
    return (producer.stage, "F" if producer.kind == "F" else "G", producer.microbatch)


def _compiled(schedule, n_stages, flat, base, prev, deps, run_order) -> PreparedSchedule:
    peak_stage, peak_rank = in_flight_peaks(schedule, n_stages)
    return PreparedSchedule(n_stages, sorted(schedule), flat, [base[r] + i for r, i in run_order], prev, deps,
                            peak_stage, peak_rank)


def in_flight_peaks(schedule: dict, n_stages: int) -> tuple[list[int], list[int]]:
    """(per stage, per rank in rank order) the most microbatches whose activations are held at once:
    a microbatch is held from its ``F`` until its ``W`` or ``BW``. Only each rank's own order of
    compute actions matters (sends and receives change no count), so a compute-only order gives the
    same peaks as the schedule with its transfers."""
    peak_stage, peak_rank = [0] * n_stages, []
    for r in sorted(schedule):
        held, per, top = 0, {}, 0
        for a in schedule[r]:
            if a.kind == "F":
                held += 1
                per[a.stage] = per.get(a.stage, 0) + 1
                peak_stage[a.stage] = max(peak_stage[a.stage], per[a.stage])
                top = max(top, held)
            elif a.kind in ("W", "BW"):
                held -= 1
                per[a.stage] -= 1
        peak_rank.append(top)
    return peak_stage, peak_rank


def simulate(schedule: Union[dict, PreparedSchedule], costs: Optional[StageCosts] = None) -> SimResult:
    """Time ``schedule`` under ``costs`` (default F=B=W=1, no latency); raises DeadlockError if stuck.

    Pass ``prepare(schedule)`` instead of the dict to time one schedule under many costs: each call
    is then one max-plus pass over the actions (about a microsecond per action).
    """
    prep = schedule if isinstance(schedule, PreparedSchedule) else prepare(schedule)
    costs = costs if costs is not None else StageCosts()
    table = costs.table(prep.n_stages)
    lat = costs.latency
    flat, prev, deps = prep.actions, prep.prev, prep.deps
    dur = [table[a.kind][a.stage] if a.kind in table else 0.0 for _, a in flat]
    start, end = [0.0] * len(flat), [0.0] * len(flat)
    for g in prep.order:
        t = end[prev[g]] if prev[g] >= 0 else 0.0
        for d, cross in deps[g]:
            ready = end[d] + lat if cross else end[d]
            if ready > t:
                t = ready
        start[g] = t
        end[g] = t + dur[g]
    step = max(end, default=0.0)
    busy = {r: 0.0 for r in prep.ranks}
    for (r, _), d in zip(flat, dur):
        busy[r] += d
    busy_list = [busy[r] for r in prep.ranks]
    bubble = 1.0 - sum(busy_list) / (len(prep.ranks) * step) if step > 0 else 0.0
    events = [(r, a, start[g], end[g]) for g, (r, a) in enumerate(flat)]
    return SimResult(step, busy_list, bubble, list(prep.peak_stage), list(prep.peak_rank), events)
