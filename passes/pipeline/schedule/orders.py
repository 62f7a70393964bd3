"""Compute orders of the pipeline schedules: ``<name>_order(p, m, v) -> dict[rank, list[Action]]``.

Each function writes the per-rank order of compute actions (F, B, W, BW) only; ``generators.generate``
adds the SEND/RECV pairs and ``registry.py`` says which schedule name uses which order (with its
stage placement, virtual stages and validity). Stages are numbered 0..S-1 in pipeline order.

Schedules (p ranks, m microbatches):

* ``gpipe``: all forwards, then all full backwards (Huang et al. 2019). Peak m activations per stage.
* ``1f1b``: p-1-r warm-up forwards on rank r, then one forward / one backward, then drain
  (PipeDream-Flush, Narayanan et al. 2021). Peak p-r activations on rank r.
* ``interleaved-1f1b`` (v = 2) and ``interleaved-1f1b-v<N>`` (any v >= 2): v stages per rank, stage s
  on rank s % p; Megatron-LM's order (Narayanan et al. 2021, sec. 2.2): forwards walk the local stages
  in rounds of g microbatches, warm-up 2(p-1-r) + (v-1)g forwards, backwards mirror the forwards.
  Any m >= 1 (Llama 3, Dubey et al. 2024 sec. 3.3.2, runs microbatch counts that are not a multiple
  of p): the m microbatches form max(1, m // p) rounds of sizes as equal as possible, the larger
  ones first, so every round but a lone short one (m < p) has at least p microbatches. Where torch's
  ``ScheduleInterleaved1F1B`` accepts m (rounds of equal size), this is its order (the tests
  compare). Uniform costs, F = B = 1/v per stage: step 3m + 3(p-1)/v for m >= p, so bubble
  (p-1)/(vm+p-1), multiple of p or not; for m < p, 3m + 3(p-1)/v + 3(p-m)(v-1)/v.
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

>>> [str(a) for a in one_f_one_b_order(2, 2, 1)[1]]
['1F0', '1BW0', '1F1', '1BW1']
>>> interleaved_rounds(4, 10), interleaved_rounds(4, 9), interleaved_rounds(4, 3)
([range(0, 5), range(5, 10)], [range(0, 5), range(5, 9)], [range(0, 3)])
"""
from __future__ import annotations

from autoshard.passes.pipeline.schedule.actions import Action

__all__ = ["gpipe_order", "one_f_one_b_order", "interleaved_rounds", "interleaved_order", "zb_h1_order", "zbv_order",
           "dualpipev_order"]


def gpipe_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
    return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "BW", i) for i in range(m)] for r in range(p)}


def one_f_one_b_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, "F", warm + i), Action(r, "BW", i)]
        acts += [Action(r, "BW", i) for i in range(m - warm, m)]
        out[r] = acts
    return out


def interleaved_rounds(p: int, m: int) -> list[range]:
    """The microbatch rounds of interleaved 1F1B: max(1, m // p) consecutive ranges of sizes as equal
    as possible, the larger first (module docstring)."""
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    out, start = [], 0
    for k in range(rounds):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def interleaved_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
    rounds = interleaved_rounds(p, m)
    forward = [(c, i) for group in rounds for c in range(v) for i in group]
    backward = [(v - 1 - c, i) for group in rounds for c in range(v) for i in group]
    total = m * v
    out = {}
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * len(rounds[0]), total)
        acts = [Action(c * p + r, "F", i) for c, i in forward[:warm]]
        for k in range(total - warm):
            c, i = forward[warm + k]
            acts.append(Action(c * p + r, "F", i))
            c, i = backward[k]
            acts.append(Action(c * p + r, "BW", i))
        acts += [Action(c * p + r, "BW", i) for c, i in backward[total - warm:]]
        out[r] = acts
    return out


def zb_h1_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
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


def zbv_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
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


def dualpipev_order(p: int, m: int, v: int) -> dict[int, list[Action]]:
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
