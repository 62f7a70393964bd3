"""Pipeline schedules: generators, simulator, deadlock check, timelines (single process, no torch.distributed).

Known answers on uniform costs: GPipe/1F1B bubble (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1) for any
v >= 2 and any m >= p (a multiple of p or not), ZB-H1 a third of 1F1B's idle time, ZBV and DualPipeV
the step times derived in orders.py.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from autoshard.passes.errors import AutoshardError
from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS, Action
from autoshard.passes.pipeline.schedule.generators import SCHEDULE_NAMES, generate, prepared, stage_rank
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.schedule.simulate import (DeadlockError, ScheduleError, StageCosts, check_deadlock, prepare,
                                                simulate)
from autoshard.passes.pipeline.schedule.timeline import chrome_trace, draw_timeline

PS = range(2, 9)
KINDS = {"gpipe": {"F", "BW"}, "1f1b": {"F", "BW"}, "interleaved-1f1b": {"F", "BW"}, "interleaved-1f1b-v3": {"F", "BW"},
         "interleaved-1f1b-v4": {"F", "BW"}, "interleaved-1f1b-v5": {"F", "BW"}, "interleaved-1f1b-v6": {"F", "BW"},
         "interleaved-1f1b-v7": {"F", "BW"}, "interleaved-1f1b-v8": {"F", "BW"}, "zb-h1": {"F", "B", "W"},
         "zbv": {"F", "B", "W"}, "dualpipev": {"F", "B", "W", "BW"}}  # dualpipev splits only its last backwards


def _microbatches(name: str, p: int) -> list[int]:
    if name.startswith("interleaved-1f1b"):  # multiples of p or not, fewer than p too
        return [1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 2]
    if name == "dualpipev":
        return [2 * p, 2 * p + 1, 3 * p + 2]
    return [1, p - 1, p, 2 * p + 1, 3 * p]


def _first_last(result, rank: int) -> tuple[float, float]:
    spans = [(s, e) for r, a, s, e in result.events if r == rank and a.kind in COMPUTE_KINDS]
    return min(s for s, _ in spans), max(e for _, e in spans)


def test_every_generator_is_deadlock_free_and_complete():
    assert set(SCHEDULE_NAMES) == set(KINDS)
    for name in SCHEDULE_NAMES:
        v = get_schedule(name).virtual_stages
        for p in (PS if v <= 4 else (2, 3, 8)):  # v 5-8 run the same generator as v 2-4: a few p keep the test fast
            owner = stage_rank(name, p, v)
            assert len(owner) == p * v and sorted(set(owner)) == list(range(p))
            for m in _microbatches(name, p):
                sched = generate(name, p, m, v)
                compute = [(a.stage, a.kind, a.microbatch) for acts in sched.values() for a in acts
                           if a.kind in COMPUTE_KINDS]
                assert len(compute) == len(set(compute))  # every action exactly once ...
                assert {(st, i) for st, k, i in compute if k == "F"} == {(st, i) for st in range(p * v)
                                                                         for i in range(m)}  # ... and all there
                check_deadlock(sched)                       # posted (isend-like) sends
                check_deadlock(sched, blocking_sends=True)  # and the strict rendezvous reading
                for r, acts in sched.items():
                    for a in acts:
                        if a.kind in COMPUTE_KINDS:
                            assert owner[a.stage] == r, (name, p, m, a)
                        else:  # transfers only between neighbouring stages on different ranks
                            assert abs(a.peer - a.stage) == 1 and owner[a.peer] != r, (name, p, m, a)
                kinds = {a.kind for acts in sched.values() for a in acts if a.kind in COMPUTE_KINDS}
                assert kinds == KINDS[name], (name, p, m, kinds)


def test_gpipe_and_1f1b_textbook_bubble_and_memory():
    for p in PS:
        for m in (1, p, 2 * p + 1, 4 * p):
            for name in ("gpipe", "1f1b"):
                r = simulate(generate(name, p, m), StageCosts(f=1, b=1, w=1))
                assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (name, p, m)
                assert r.step_time == pytest.approx(3 * (m + p - 1))
                assert r.busy == [pytest.approx(3 * m)] * p
            assert simulate(generate("gpipe", p, m)).peak_stage == [m] * p
            assert simulate(generate("1f1b", p, m)).peak_stage == [min(p - i, m) for i in range(p)]


def test_interleaved_textbook_bubble():
    """Megatron's (p-1)/(vm+p-1) for every v in 2..4 and every m >= p, multiple of p or not; below p
    the pipe never fills: 3(p-m)(v-1)/v more (orders.py)."""
    for p in PS:
        for v in (2, 3, 4):
            name = "interleaved-1f1b" if v == 2 else f"interleaved-1f1b-v{v}"
            for m in range(1, 3 * p + 2):
                r = simulate(generate(name, p, m), StageCosts(f=1 / v, b=1 / v, w=1 / v))
                if m >= p:
                    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m)
                    assert r.step_time == pytest.approx(3 * m + 3 * (p - 1) / v)
                else:
                    assert r.step_time == pytest.approx(3 * m + 3 * (p - 1) / v + 3 * (p - m) * (v - 1) / v), (p, v, m)
                assert r.busy == [pytest.approx(3 * m)] * p


def test_zb_h1_bubble_is_a_third_of_1f1b_at_same_peak_memory():
    for p in PS:
        for m in (1, p - 1, p, 2 * p + 1, 4 * p):
            zb = simulate(generate("zb-h1", p, m))
            one = simulate(generate("1f1b", p, m))
            # idle per rank: (p-1) once every rank has a microbatch in flight (m >= p), vs 3(p-1) for 1F1B
            assert zb.step_time == 3 * m + (p - 1) + max(0, p - m), (p, m)
            if m >= p:
                assert (zb.step_time - 3 * m) / (one.step_time - 3 * m) == pytest.approx(1 / 3)
                assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
            assert max(zb.peak_rank) == max(one.peak_rank) == min(p, m)


def test_zbv_step_time_matches_derivation():
    for p in PS:
        knee = (3 * p) // 2  # the two regimes meet where 2m = 3p - 1
        for m in sorted({1, 2, p, knee - 1, knee, knee + 1, 2 * p - 1, 2 * p, 3 * p + 1}):
            r = simulate(generate("zbv", p, m))
            assert r.step_time == max(6 * m + p - 1, 4 * m + 4 * p - 2), (p, m)
            if 2 * m >= 3 * p - 1:
                assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
            if m >= 2 * p - 1:  # rank r idles r at the start, p-1-r at the end, never in between
                for rank in range(p):
                    assert _first_last(r, rank) == (rank, r.step_time - (p - 1 - rank))
                    assert r.busy[rank] == 6 * m
            if m >= 2 * p:
                assert r.peak_rank == [2 * p] * p  # p full-size activations per rank, as 1F1B's rank 0


def test_dualpipev_step_time_matches_derivation():
    for p in PS:
        for m in (2 * p, 2 * p + 1, 3 * p + 2):
            r = simulate(generate("dualpipev", p, m))
            assert r.step_time == 6 * m + p - 1, (p, m)
            for rank in range(p):  # idle r at the start, p-1-r inside, none at the end
                assert _first_last(r, rank) == (rank, r.step_time)
            assert r.peak_rank == [2 * p + 1] * p


def test_v_and_interleaved_orders_match_torch_pipelining():
    """Cross-check our compute orders against torch.distributed.pipelining's independent generators."""
    from torch.distributed.pipelining import schedules as ts
    kind = {ts._ComputationType.FORWARD: "F", ts._ComputationType.BACKWARD_INPUT: "B",
            ts._ComputationType.BACKWARD_WEIGHT: "W", ts._ComputationType.FULL_BACKWARD: "BW"}

    def torch_orders(cls, p, m, v=2):
        sched = object.__new__(cls)  # only the per-rank order calculation is used: no process group
        sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = p, m, v
        sched._num_stages = sched.num_stages = v * p
        sched.number_of_rounds = max(1, m // p)  # torch's rounds (it needs m % rounds == 0)
        sched.microbatches_per_round = m // sched.number_of_rounds
        out = {}
        for rank in range(p):
            acts = []
            for a in sched._calculate_single_rank_operations(rank):
                for sub in (a.sub_actions or (a,)) if a is not None else ():
                    acts.append((sub.stage_index, kind[sub.computation_type], sub.microbatch_index))
            out[rank] = acts
        return out

    def ours(name, p, m):
        return {r: [(a.stage, a.kind, a.microbatch) for a in acts if a.kind in COMPUTE_KINDS]
                for r, acts in generate(name, p, m).items()}

    for p in (2, 3, 4, 8):
        for m in (2 * p, 2 * p + 3):
            assert ours("dualpipev", p, m) == torch_orders(ts.ScheduleDualPipeV, p, m), (p, m)
        for m in (p, 2 * p + 3):
            assert ours("zbv", p, m) == torch_orders(ts.ScheduleZBVZeroBubble, p, m), (p, m)
        for v in (2, 3, 4):  # torch's flexible rounds: m = 3 < p = 4 and m = 10 on p = 4 are not multiples of p
            name = "interleaved-1f1b" if v == 2 else f"interleaved-1f1b-v{v}"
            for m in {p, 2 * p, p + 1, p - 1, 2 * p + 2} - {1}:
                if m % max(1, m // p) == 0:
                    assert ours(name, p, m) == torch_orders(ts.ScheduleInterleaved1F1B, p, m, v), (p, m, v)


def test_simulator_known_answers_latency_and_per_stage_costs():
    one = generate("1f1b", 2, 1)
    r = simulate(one, StageCosts(f=1, b=1, w=1, latency=0.5))
    assert r.step_time == pytest.approx(7.0)  # F0 | L | F1 BW1 (3) | L | BW0 (2)
    # GPipe p=2 m=2, stage 1's forward twice as slow: rank 1 runs F0 1..3, F1 3..5, BW0, BW1 to 9;
    # rank 0 back-propagates after 7 and 9
    r = simulate(generate("gpipe", 2, 2), StageCosts(f=[1, 2], b=1, w=1))
    assert (r.step_time, r.busy) == (11.0, [6.0, 8.0])
    assert r.bubble_fraction == pytest.approx(1 - 14 / 22)
    assert [(str(a), s, e) for rk, a, s, e in r.events if rk == 0 and a.kind in COMPUTE_KINDS] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0BW0", 7, 9), ("0BW1", 9, 11)]
    sched = generate("zbv", 4, 9)
    costs = StageCosts(f=[1, 2, 1, 3, 1, 1, 2, 1], b=1.5, w=0.5, latency=0.25)
    a, b = simulate(sched, costs), simulate(prepare(sched), costs)
    assert (a.step_time, a.busy, a.events) == (b.step_time, b.busy, b.events)
    c = simulate(prepared("zbv", 4, 9), costs)
    assert (c.step_time, c.peak_stage, c.events) == (a.step_time, a.peak_stage, a.events)
    with pytest.raises(ScheduleError, match="one duration per stage"):
        simulate(sched, StageCosts(f=[1, 2]))


def _swap(acts: list[Action], i: int, j: int) -> list[Action]:
    acts = list(acts)
    acts[i], acts[j] = acts[j], acts[i]
    return acts


def test_broken_schedules_are_reported_with_the_stuck_actions():
    sched = generate("1f1b", 2, 2)
    r0 = sched[0]
    s0 = r0.index(Action(0, "SEND_F", 0, 1))
    s1 = r0.index(Action(0, "SEND_F", 1, 1))
    # swapped sends: SEND_F1 now precedes the F1 that produces it; rank 1 waits for microbatch 0
    with pytest.raises(DeadlockError) as err:
        check_deadlock({0: _swap(r0, s0, s1), 1: sched[1]})
    msg = str(err.value)
    assert "rank 0 stuck at action #1 0SEND_F1->1" in msg and "0F1" in msg
    assert "rank 1 stuck at action #0 1RECV_F0<-0" in msg
    # sends in the wrong order after both forwards: the receiver sees microbatch 1 first
    bad = [a for a in r0 if a.kind != "SEND_F"]
    f1 = bad.index(Action(0, "F", 1))
    bad[f1 + 1:f1 + 1] = [r0[s1], r0[s0]]
    with pytest.raises(DeadlockError, match="match in order"):
        check_deadlock({0: bad, 1: sched[1]})
    # fine with posted sends, deadlocks if sends block: both ranks send before they receive
    r1 = [a for a in sched[1] if a != Action(1, "RECV_F", 1, 0)]
    r1.insert(r1.index(Action(1, "SEND_B", 0, 0)) + 1, Action(1, "RECV_F", 1, 0))
    check_deadlock({0: r0, 1: r1})
    with pytest.raises(DeadlockError) as err:
        check_deadlock({0: r0, 1: r1}, blocking_sends=True)
    assert "rank 0 stuck at action #3 0SEND_F1->1" in str(err.value)
    assert "rank 1 stuck at action #3 1SEND_B0->0" in str(err.value)
    with pytest.raises(DeadlockError):
        simulate({0: _swap(r0, s0, s1), 1: sched[1]})


def test_malformed_schedules_and_bad_arguments():
    sched = generate("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="appears twice"):
        check_deadlock({0: sched[0] + [Action(0, "F", 0)], 1: sched[1]})
    with pytest.raises(ScheduleError, match="stage 0 microbatch 1"):
        check_deadlock({0: [a for a in sched[0] if a != Action(0, "BW", 1)], 1: sched[1]})
    compute_only = {r: [a for a in acts if a.kind in COMPUTE_KINDS] for r, acts in sched.items()}
    with pytest.raises(ScheduleError, match="has no RECV_F"):
        check_deadlock(compute_only)
    check_deadlock(compute_only, require_comms=False)
    assert simulate(compute_only).step_time == simulate(sched).step_time
    with pytest.raises(ScheduleError, match="sends without a matching RECV: stage 0->1 F mb 1"):
        check_deadlock({0: sched[0], 1: [a for a in sched[1] if a != Action(1, "RECV_F", 1, 0)]}, require_comms=False)
    with pytest.raises(ScheduleError, match="exactly 2 stages per rank; got virtual=3; for 3 stages per rank use "
                                            "'interleaved-1f1b-v3'"):
        generate("interleaved-1f1b", 4, 5, 3)
    with pytest.raises(ScheduleError, match="unknown schedule 'interleaved-1f1b-v1'"):
        generate("interleaved-1f1b-v1", 4, 5)
    with pytest.raises(ScheduleError, match="m=6 < 2\\*p=8"):
        generate("dualpipev", 4, 6)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        generate("zb-h2", 4, 8)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        generate("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="exactly 2 stages"):
        generate("zbv", 4, 8, 3)
    assert issubclass(DeadlockError, AutoshardError)


def test_chrome_trace_and_svg_timeline(tmp_path):
    r = simulate(generate("zb-h1", 3, 4), StageCosts(f=1e-3, b=1e-3, w=1e-3))
    events = r.trace_events()
    path = chrome_trace(events + [(0, "optimizer", 0.02, 0.021, None)], tmp_path / "trace.json")
    data = json.load(open(path))
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 * 4 * 3 + 1
    first = next(e for e in xs if e["name"] == "1F0")
    assert (first["pid"], first["tid"], first["cat"], first["args"]["microbatch"]) == (1, 1, "F", 0)
    assert first["ts"] == pytest.approx(1e3) and first["dur"] == pytest.approx(1e3)
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    with pytest.raises(ScheduleError, match="before it starts"):
        chrome_trace([(0, "x", 2.0, 1.0, 0)], tmp_path / "bad.json")

    svg = draw_timeline(simulate(generate("zbv", 2, 4)), tmp_path / "t.svg", title="zbv p=2 m=4")
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    boxes = root.findall(f"{ns}g/{ns}rect")
    assert len(boxes) == 2 * 2 * 3 * 4
    labels = [t.text for t in root.findall(f"{ns}g/{ns}text")]
    assert {"0F0", "3B3", "1W2", "2F1"} <= set(labels)  # two stages per rank: the stage leads the label
    fill = {g.find(f"{ns}title").text.split(":")[0]: g.find(f"{ns}rect").get("fill") for g in root.findall(f"{ns}g")}
    assert fill["stage 0 F microbatch 0"] != fill["stage 0 F microbatch 1"]  # colour follows the microbatch
    assert fill["stage 0 F microbatch 0"] != fill["stage 0 W microbatch 0"]  # shade follows the kind
    assert fill["stage 0 F microbatch 2"] == fill["stage 3 F microbatch 2"]
