"""Pipeline schedule generators: ``generate(name, p, m, v) -> dict[rank, list[Action]]``.

Each generator first writes the per-rank order of compute actions (F, B, W, BW); ``_with_comms``
then adds a SEND/RECV pair for every cross-rank transfer. Stages are numbered 0..S-1 in pipeline
order; ``stage_rank`` says which rank owns each; ``prepared`` memoises ``prepare(generate(...))`` for
callers (the stage planner) that time one schedule under many costs.

Schedules (p ranks, m microbatches):

* ``gpipe``: all forwards, then all full backwards (Huang et al. 2019). Peak m activations per stage.
* ``1f1b``: p-1-r warm-up forwards on rank r, then one forward / one backward, then drain
  (PipeDream-Flush, Narayanan et al. 2021). Peak p-r activations on rank r.
* ``interleaved-1f1b``: v stages per rank, stage s on rank s % p; Megatron-LM's order (Narayanan
  et al. 2021, sec. 2.2): forwards walk the local stages in groups of p microbatches, warm-up
  2(p-1-r) + (v-1)p forwards, backwards mirror the forwards. Needs m % p == 0.
* ``zb-h1``: 1F1B with backward split into B (input grad) and W (weight grad), W deferred to fill
  the bubbles (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", schedule ZB-H1). Rank r runs
  1F1B's order with every BW split into B then W, except that it keeps its r oldest W's pending
  (each later B releases the oldest one) and runs them last. The last ranks thereby turn gradients
  around at once while the deferred W's fill the drain. Every rank holds at most p activations,
  1F1B's peak (rank 0's). With F=B=W the step is 3m + p - 1: bubble (p-1) per rank instead of
  1F1B's 3(p-1).
* ``zbv``: V placement (rank r owns stages r and 2p-1-r), the ZB-V order of Qi et al. 2024
  ("Pipeline Parallelism with Controllable Memory"): 2(p-r)-1 forwards of the first chunk, r pairs
  (F second chunk, F first chunk), p-r triples (F, B, W of the second chunk), a steady phase of
  F B W on both chunks, then B-only drains and the deferred W's.
* ``dualpipev``: DeepSeek's DualPipeV (DeepSeek-V3 report 2024, ``dualpipev.py`` of
  deepseek-ai/DualPipe), V placement. Our reading of its eight steps for rank r:
  (1) 2(p-1-r) F of chunk 0; (2) r+1 pairs F0, F1; (3) p-1-r of B1 (input grad only), W, F1;
  (4) m-2p+r+1 rounds of [F0 overlapped with BW1] then [F1 overlapped with BW0]; (5) p-1-r rounds
  of BW1 then [F1 overlapped with BW0]; (6) r+1 pairs B1, B0 whose second half splits off W (zero
  bubble, where the split starts depends on the parity of r); (7) p-1-r pairs W, B0 (split);
  (8) r+1 W's. W's run oldest first. An "overlapped" pair is emitted as F then BW: our IR runs one
  compute action at a time, so the compute/communication overlap DualPipe gets inside a pair is not
  modelled. Chunk 0 is stage r, chunk 1 is stage 2p-1-r. Needs m >= 2p.

The zbv, dualpipev and interleaved-1f1b compute orders equal those of torch.distributed.pipelining
(``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, ``ScheduleInterleaved1F1B``; the tests compare).

What the zero-bubble generators achieve, F = B = W = 1 per stage (a V stage is half a layer stack,
so each rank does 6m units for zbv/dualpipev and 3m for zb-h1); tests/passes/pipeline/test_schedules.py asserts each:

* zb-h1, m >= p: step 3m + p - 1, bubble (p-1)/(3m+p-1), a third of 1F1B's idle 3(p-1) per rank.
  Why: rank r starts after r forwards and, with r W's deferred, never waits for a gradient (the
  last rank sends each B on at once), so its only idle is r at the start plus p-1-r before its
  first B; the deferred W's exactly fill the drain. For m < p: 3m + 2p - 1 - m.
* zbv, 2m >= 3p - 1: step 6m + p - 1, bubble (p-1)/(6m+p-1). Why: the first forward reaches rank r
  at time r (stages 0..r-1 run first); from then on the V keeps every rank busy (each rank owns one
  stage of the way down and one of the way back, so a microbatch's work alternates between its two
  chunks) until the drain, where rank r finishes p-1-r before the end (the last backward leaves
  stage 2p-1 on rank 0 and comes back to stage 0 on rank 0); so step = r + 6m + (p-1-r). The tests
  check the head/tail idle and the busy time per rank for m >= 2p-1. For small m the pipe never
  fills and the step is 4m + 4p - 2 (measured; asserted for p <= 8): max(6m + p - 1, 4m + 4p - 2).
* dualpipev, m >= 2p: step 6m + p - 1, the same as zbv: rank r idles r at the start and p-1-r inside
  its steady phase (waiting for a chunk-0 gradient), none at the end; it holds 2p+1 half-stage
  activations per rank (zbv: 2p). Its real-world gain, overlapping the F and B of a pair, is
  outside a one-action-at-a-time model.

>>> sched = generate("1f1b", 2, 2)
>>> [str(a) for a in sched[0]]
['0F0', '0SEND_F0->1', '0F1', '0SEND_F1->1', '0RECV_B0<-1', '0BW0', '0RECV_B1<-1', '0BW1']
>>> stage_rank("zbv", 2), stage_rank("interleaved-1f1b", 2, 2)
([0, 1, 1, 0], [0, 1, 0, 1])
"""
from __future__ import annotations

import functools

from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.simulate import PreparedSchedule, ScheduleError, StageCosts, prepare, simulate

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
_V_SHAPED = ("zbv", "dualpipev")


def stage_rank(schedule: str, p: int, v: int = 1) -> list[int]:
    """Rank owning each stage: round-robin ``s % p`` (v stages per rank), or V for zbv/dualpipev."""
    _check_name(schedule)
    if schedule in _V_SHAPED:
        return list(range(p)) + list(range(p - 1, -1, -1))
    return [s % p for s in range(p * v)]


def generate(schedule: str, n_stages_physical: int, n_microbatches: int, virtual: int = 1) -> dict[int, list[Action]]:
    """Per-rank action lists for ``schedule`` on p = ``n_stages_physical`` ranks and m microbatches.

    ``virtual`` is the number of stages per rank for interleaved-1f1b; zbv and dualpipev always put 2
    stages on each rank (pass 1 or 2). The result passes ``check_deadlock`` (also with blocking
    sends).
    """
    _check_name(schedule)
    p, m, v = n_stages_physical, n_microbatches, virtual
    if not (isinstance(p, int) and isinstance(m, int) and isinstance(v, int)) or p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"need integers p >= 1, m >= 1, virtual >= 1; got p={p}, m={m}, virtual={v}")
    if schedule in _V_SHAPED:
        if v not in (1, 2):
            raise ScheduleError(f"{schedule} places exactly 2 stages per rank (V shape); got virtual={v}, pass 2")
        v = 2
    elif schedule != "interleaved-1f1b" and v != 1:
        raise ScheduleError(f"{schedule} runs one stage per rank; got virtual={v}. Use interleaved-1f1b, zbv or "
                            f"dualpipev for several stages per rank")
    if schedule == "interleaved-1f1b" and m % p:
        raise ScheduleError(f"interleaved-1f1b needs the microbatch count to be a multiple of the pipeline size: "
                            f"m={m} % p={p} = {m % p}; use m={m + p - m % p} or {m - m % p or p}")
    if schedule == "dualpipev" and m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least 2 microbatches per rank pair: m={m} < 2*p={2 * p}; "
                            f"use m >= {2 * p} or the zbv schedule")
    maker = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved-1f1b": _interleaved, "zb-h1": _zb_h1,
             "zbv": _zbv, "dualpipev": _dualpipev}[schedule]
    compute = maker(p, m, v)
    return _with_comms(compute, stage_rank(schedule, p, v))


@functools.lru_cache(maxsize=512)
def prepared(schedule: str, n_stages_physical: int, n_microbatches: int, virtual: int = 1) -> PreparedSchedule:
    """``prepare(generate(...))``, memoised: time a generated schedule under many costs cheaply.

    ``simulate(prepared("1f1b", 8, 32), costs)`` costs a few ms against tens of ms for
    ``simulate(generate(...), costs)``; the result is shared, so treat it as read-only.
    """
    return prepare(generate(schedule, n_stages_physical, n_microbatches, virtual))


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {schedule!r}; schedules are {SCHEDULE_NAMES}")


def _gpipe(p: int, m: int, v: int) -> dict[int, list[Action]]:
    return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "BW", i) for i in range(m)] for r in range(p)}


def _one_f_one_b(p: int, m: int, v: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, "F", warm + i), Action(r, "BW", i)]
        acts += [Action(r, "BW", i) for i in range(m - warm, m)]
        out[r] = acts
    return out


def _interleaved(p: int, m: int, v: int) -> dict[int, list[Action]]:
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return (v - 1 - chunk if backward else chunk), mb

    out = {}
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)
        acts = []
        for k in range(warm):
            c, i = unit(k, False)
            acts.append(Action(c * p + r, "F", i))
        for k in range(total - warm):
            c, i = unit(warm + k, False)
            acts.append(Action(c * p + r, "F", i))
            c, i = unit(k, True)
            acts.append(Action(c * p + r, "BW", i))
        for k in range(total - warm, total):
            c, i = unit(k, True)
            acts.append(Action(c * p + r, "BW", i))
        out[r] = acts
    return out


def _zb_h1(p: int, m: int, v: int) -> dict[int, list[Action]]:
    """1F1B with B and W split; rank r keeps its r oldest W's pending, running each later (module doc)."""
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        pending: list[int] = []
        for i in range(m):
            if warm + i < m:
                acts.append(Action(r, "F", warm + i))
            acts.append(Action(r, "B", i))
            pending.append(i)
            if len(pending) > r:
                acts.append(Action(r, "W", pending.pop(0)))
        out[r] = acts + [Action(r, "W", i) for i in pending]
    return out


def _zbv(p: int, m: int, v: int) -> dict[int, list[Action]]:
    n = max(2 * p - 1, m)  # build the full-pipeline pattern, then drop microbatches >= m
    out = {}
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        c = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        acts: list[Action] = []

        def add(stage, kind, counter):
            acts.append(Action(stage, kind, c[counter]))
            if kind != "W":
                c[counter] += 1

        def f0():
            add(s0, "F", "f0")

        def f1():
            add(s1, "F", "f1")

        def bw(chunk, with_w):
            stage, key = (s0, "b0") if chunk == 0 else (s1, "b1")
            add(stage, "B", key)
            if with_w:
                acts.append(Action(stage, "W", c[key] - 1))

        for _ in range(2 * (p - r) - 1):
            f0()
        for _ in range(r):
            f1()
            f0()
        for _ in range(p - r):
            f1()
            bw(1, True)
        while c["f1"] < c["f0"] or c["f0"] < n:
            if c["f0"] < n:
                f0()
            bw(0, True)
            f1()
            bw(1, True)
        w0, w1 = c["b0"], c["b1"]
        for _ in range(r):
            bw(0, False)
            bw(1, False)
        for _ in range(p - r):
            bw(0, False)
            acts.append(Action(s0, "W", w0))
            w0 += 1
        acts += [Action(s1, "W", i) for i in range(w1, c["b1"])]
        acts += [Action(s0, "W", i) for i in range(w0, c["b0"])]
        out[r] = [a for a in acts if a.microbatch < m]
    return out


def _dualpipev(p: int, m: int, v: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        stages = (r, 2 * p - 1 - r)
        nf, nb = [0, 0], [0, 0]
        wq: list[tuple[int, int]] = []
        acts: list[Action] = []

        def f(chunk):
            acts.append(Action(stages[chunk], "F", nf[chunk]))
            nf[chunk] += 1

        def b(chunk, split):
            acts.append(Action(stages[chunk], "B" if split else "BW", nb[chunk]))
            if split:
                wq.append((stages[chunk], nb[chunk]))
            nb[chunk] += 1

        def w():
            if wq:
                s, i = wq.pop(0)
                acts.append(Action(s, "W", i))

        for _ in range(2 * (p - 1 - r)):
            f(0)
        for _ in range(r + 1):
            f(0)
            f(1)
        for _ in range(p - 1 - r):
            b(1, True)
            w()
            f(1)
        for _ in range(m - 2 * p + r + 1):
            f(0)
            b(1, False)
            f(1)
            b(0, False)
        for _ in range(p - 1 - r):
            b(1, False)
            f(1)
            b(0, False)
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            b(1, split)
            if i == half and r % 2 == 0:
                split = True
            b(0, split)
        for _ in range(p - 1 - r):
            w()
            b(0, True)
        for _ in range(r + 1):
            w()
        out[r] = acts
    return out


def _with_comms(compute: dict[int, list[Action]], owner: list[int]) -> dict[int, list[Action]]:
    """Add SEND/RECV pairs by projecting one global order of events onto every rank.

    Runs the compute-only schedule at unit costs, then orders every compute action by its start and
    every transfer at the moment its producer ends (just before anything starting then). Because all
    ranks read their lists off this single sequence, a transfer sits between its producer and its
    consumer on both sides and all ranks agree on the order of transfers, so the schedule completes
    even if every send blocks until its receive (the proof: run the global sequence in order).
    """
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
    seq.sort(key=lambda e: e[:4])
    out: dict[int, list[Action]] = {r: [] for r in compute}
    for *_, items in seq:
        for r, a in items:
            out[r].append(a)
    return out
