"""The dry run of a pipeline schedule: which action can run when, and a proof that it completes.

A schedule is ``dict[rank, list[Action]]`` (see ``actions.py``). Each rank runs its list in order,
one action at a time. Data dependencies between compute actions (S stages, stage ``s``, microbatch
``i``):

* ``F(s, i)`` needs ``F(s-1, i)``;
* ``B(s, i)`` / ``BW(s, i)`` needs the input gradient of stage ``s+1`` (``B`` or ``BW`` of ``s+1``),
  or, on the last stage, its own ``F(s, i)``;
* ``W(s, i)`` needs ``B(s, i)``.

Communication semantics (what the runtime must honour): ``SEND_*`` is posted without waiting for the
receiver (an ``isend``; zero time on the compute stream); ``RECV_*`` blocks its rank until the
matching send has been posted and the payload arrived. Transfers between one pair of ranks match in
FIFO order per direction, so a receiver must take them in the order the sender posted them. A compute
action whose input comes from another rank must come after that input's RECV on its rank.
``check_deadlock(..., blocking_sends=True)`` also proves the stricter rendezvous reading (a send
waits for its receive); every generated schedule passes both. Timing is ``simulate.py``'s.
"""
from __future__ import annotations

from typing import Optional

from autoshard.passes.errors import AutoshardError
from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS, Action

__all__ = ["ScheduleError", "DeadlockError", "stage_owners", "transfer_key", "compute_deps", "input_key", "dry_run",
           "check_complete", "incomplete_pairs", "check_deadlock"]


class ScheduleError(AutoshardError):
    """A schedule is malformed (missing/duplicate actions, unknown stages) or cannot be generated."""


class DeadlockError(ScheduleError):
    """A schedule cannot complete: names the first stuck action of every rank and what it waits for."""


def stage_owners(schedule: dict) -> tuple[int, dict[int, int]]:
    """Number of stages and the rank of each stage; raises on a stage run by two ranks."""
    owner: dict[int, int] = {}
    for rank, actions in schedule.items():
        for a in actions:
            if a.kind in ("F", "B", "W", "BW"):
                if owner.setdefault(a.stage, rank) != rank:
                    raise ScheduleError(f"stage {a.stage} has compute actions on ranks {owner[a.stage]} and {rank}; "
                                        f"a stage must live on exactly one rank")
    n = max(owner) + 1 if owner else 0
    missing = [s for s in range(n) if s not in owner]
    if missing:
        raise ScheduleError(f"stages {missing} have no compute actions; stages must be numbered 0..S-1")
    return n, owner


def transfer_key(a: Action) -> tuple:
    """Identity shared by a SEND and its RECV: (direction, src stage, dst stage, microbatch)."""
    if a.kind.startswith("SEND"):
        return (a.kind[-1], a.stage, a.peer, a.microbatch)
    return (a.kind[-1], a.peer, a.stage, a.microbatch)


def compute_deps(a: Action, n_stages: int) -> list[tuple]:
    """Compute-action keys ``(stage, kind, mb)`` that ``a`` waits for; ("G", s, i) = input grad of s."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [(s - 1, "F", i)] if s > 0 else []
    if a.kind in ("B", "BW"):
        return [(s, "F", i)] + ([(s + 1, "G", i)] if s < n_stages - 1 else [])
    if a.kind == "W":
        return [(s, "B", i)]
    return []


def input_key(dep: tuple, consumer: int) -> tuple:
    """Transfer key of the RECV that brings dependency ``dep`` of stage ``consumer`` in."""
    s, kind, i = dep
    return ("F", s, consumer, i) if kind == "F" else ("B", s, consumer, i)


def dry_run(schedule: dict, *, comms: str, need_recv: bool) -> tuple[list, set, Optional[list[str]], int, dict]:
    """The dry run: (completion order as (rank, index), completed keys, stuck lines or None, S, owner).

    ``comms``: "eager" (a send is posted and its rank moves on) or "rendezvous" (a send waits for its
    receive); both match transfers FIFO per directed rank pair. ``need_recv``: a compute action whose
    input comes from another rank also waits for that input's RECV on its own rank. Each rank is
    revisited only when a rank it exchanges data with made progress: linear in the actions.
    """
    n_stages, owner = stage_owners(schedule)
    ranks = sorted(schedule)
    lists = {r: schedule[r] for r in ranks}
    ptr = {r: 0 for r in ranks}
    done: set = set()                      # (stage, kind, mb); ("G" kind: input grad of the stage ready)
    channel: dict[tuple, list] = {}        # (src rank, dst rank) -> FIFO of posted, unreceived keys
    order: list[tuple[int, int]] = []
    received: set = set()
    mismatch: dict[int, str] = {}
    near: dict[int, set] = {r: set() for r in ranks}
    for st, r in owner.items():
        for t in (st - 1, st + 1):
            if t in owner and owner[t] != r:
                near[r].add(owner[t])
    for r in ranks:
        for a in lists[r]:
            if a.peer is not None and a.peer in owner and owner[a.peer] != r:
                near[r].add(owner[a.peer])
                near[owner[a.peer]].add(r)
    work, queued = list(reversed(ranks)), set(ranks)
    while work:
        r = work.pop()
        queued.discard(r)
        progress = False
        acts = lists[r]
        while ptr[r] < len(acts):
            a = acts[ptr[r]]
            k = a.kind
            if k in COMPUTE_KINDS:
                ds = compute_deps(a, n_stages)
                if not all(d in done for d in ds):
                    break
                if need_recv and not all(input_key(d, a.stage) in received for d in ds if owner[d[0]] != r):
                    break
                key = (a.stage, k, a.microbatch)
                if key in done:
                    raise ScheduleError(f"action {a} appears twice (rank {r})")
                done.add(key)
                if k in ("B", "BW"):
                    done.add((a.stage, "G", a.microbatch))
            elif k.startswith("SEND"):
                dst = owner.get(a.peer)
                if dst is None:
                    raise ScheduleError(f"{a} on rank {r} sends to stage {a.peer}, which no rank runs")
                if (a.stage, "F" if k == "SEND_F" else "G", a.microbatch) not in done:
                    break  # its payload is not computed yet
                key = transfer_key(a)
                q = channel.setdefault((r, dst), [])
                if comms == "rendezvous":
                    # parked until the receiver takes it; the receiver's step moves this rank on
                    if not q or q[-1] != key:
                        q.append(key)
                        progress = True
                    break
                q.append(key)
            else:  # RECV
                src = owner.get(a.peer)
                if src is None:
                    raise ScheduleError(f"{a} on rank {r} receives from stage {a.peer}, which no rank runs")
                key = transfer_key(a)
                q = channel.get((src, r))
                if not q:
                    break
                if q[0] != key:
                    mismatch[r] = (f"expects {key[0]} stage {key[1]}->{key[2]} mb {key[3]} but rank {src} "
                                   f"posted stage {q[0][1]}->{q[0][2]} {q[0][0]} mb {q[0][3]} first "
                                   f"(transfers between two ranks match in order)")
                    break
                q.pop(0)
                received.add(key)
                if comms == "rendezvous":
                    order.append((src, ptr[src]))
                    ptr[src] += 1
            order.append((r, ptr[r]))
            ptr[r] += 1
            progress = True
        if progress:
            for n in near[r]:
                if n not in queued:
                    queued.add(n)
                    work.append(n)
    stuck = None
    if any(ptr[r] < len(lists[r]) for r in ranks):
        stuck = [f"  rank {r} stuck at action #{ptr[r]} {lists[r][ptr[r]]}: " +
                 mismatch.get(r, _waits_for(lists[r][ptr[r]], owner, n_stages))
                 for r in ranks if ptr[r] < len(lists[r])]
    elif any(channel.values()):
        left = [f"stage {k[1]}->{k[2]} {k[0]} mb {k[3]} (rank {src}->{dst})" for (src, dst), q in channel.items()
                for k in q]
        raise ScheduleError("sends without a matching RECV: " + "; ".join(left[:6]) +
                            "; add the RECV on the receiving rank or drop the SEND")
    return order, done, stuck, n_stages, owner


def _waits_for(a: Action, owner: dict, n_stages: int) -> str:
    if a.kind.startswith("SEND"):
        produced = f"{a.stage}{'F' if a.kind == 'SEND_F' else 'B/BW'}{a.microbatch}"
        return (f"waits for its payload {produced} (which this rank runs later or never) or for rank "
                f"{owner.get(a.peer)} to reach the matching RECV_{a.kind[-1]}")
    if a.kind.startswith("RECV"):
        return f"waits for rank {owner.get(a.peer)} to post the matching SEND_{a.kind[-1]}"
    need = ", ".join(f"{s}{'B/BW' if k == 'G' else k}{i} (rank {owner.get(s)}"
                     + (", then its RECV here)" if owner.get(s) != owner.get(a.stage) else ")")
                     for s, k, i in compute_deps(a, n_stages))
    return f"waits for {need}"


def check_complete(schedule: dict, done: dict, n_stages: int) -> None:
    """Every (stage, microbatch) ran F and either BW or B+W exactly once."""
    problems = incomplete_pairs([(r, a) for r, acts in schedule.items() for a in acts], done, n_stages)
    if problems:
        raise ScheduleError("every stage must run F and either BW or B then W for every microbatch; "
                            "incomplete: " + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else ""))


def incomplete_pairs(flat: list, done, n_stages: int) -> list[str]:
    """The (stage, microbatch) pairs of ``_check_complete``'s rule that ``done`` breaks."""
    n_mb = 1 + max((a.microbatch for _, a in flat), default=-1)
    problems = []
    for s in range(n_stages):
        for i in range(n_mb):
            has_f = (s, "F", i) in done
            bw, b, w = (s, "BW", i) in done, (s, "B", i) in done, (s, "W", i) in done
            if not (has_f and ((bw and not b and not w) or (b and w and not bw))):
                problems.append(f"stage {s} microbatch {i}: F={has_f} B={b} W={w} BW={bw}")
    return problems


def _missing_recvs(schedule: dict, owner: dict, n_stages: int) -> list[str]:
    """Cross-rank data edges with no RECV on the consumer's rank (the runtime would lack the tensor)."""
    recvs = {(r, transfer_key(a)) for r, acts in schedule.items() for a in acts if a.kind.startswith("RECV")}
    out = []
    for r, acts in schedule.items():
        for a in acts:
            if a.kind == "F" and a.stage > 0 and owner[a.stage - 1] != r:
                if (r, ("F", a.stage - 1, a.stage, a.microbatch)) not in recvs:
                    out.append(f"rank {r}: {a} has no RECV_F from stage {a.stage - 1}")
            if a.kind in ("B", "BW") and a.stage < n_stages - 1 and owner[a.stage + 1] != r:
                if (r, ("B", a.stage + 1, a.stage, a.microbatch)) not in recvs:
                    out.append(f"rank {r}: {a} has no RECV_B from stage {a.stage + 1}")
    return out


def check_deadlock(schedule: dict, *, blocking_sends: bool = False, require_comms: bool = True) -> None:
    """Prove ``schedule`` completes, or raise ``DeadlockError`` naming each rank's first stuck action.

    Runs the schedule with dependency and send/receive matching only (no costs). Also raises
    ``ScheduleError`` if a compute action is missing or duplicated, or a cross-rank input has no RECV.
    ``blocking_sends=True`` checks the rendezvous reading (a SEND waits for its RECV);
    ``require_comms=False`` accepts compute-only schedules (cross-rank edges then need no RECV).
    """
    if require_comms:
        n_stages, owner = stage_owners(schedule)
        missing = _missing_recvs(schedule, owner, n_stages)
        if missing:
            raise ScheduleError("cross-rank inputs without a RECV: " + "; ".join(missing[:6]) +
                                "; add SEND/RECV pairs (generate() emits them)")
    _, done, stuck, n_stages, owner = dry_run(schedule, comms="rendezvous" if blocking_sends else "eager",
                                           need_recv=require_comms)
    if stuck:
        mode = "rendezvous sends" if blocking_sends else "posted sends"
        raise DeadlockError(f"schedule deadlocks ({mode}); first stuck action per rank:\n" + "\n".join(stuck) +
                            "\nfix: reorder the actions so every RECV's SEND comes earlier on the sender and "
                            "every compute input is produced before it is consumed")
    check_complete(schedule, done, n_stages)
