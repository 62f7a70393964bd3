"""DeepSpeed's pipeline schedule with blocking transfers, timed on a held-out MT-NLG row's own stage
costs, next to the planner's simulated 1f1b step. It checks whether DeepSpeed's schedule is the cost
missing from that row (benchmarks/RESULTS.md, literature section).

    python benchmarks/literature_deepspeed.py [--row 420]

DeepSpeed's ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py) splits a step into 2 (m + p - 1)
slots. In each slot a stage runs one forward or one backward, and the slot carries that stage's
transfers: a forward slot sends the previous backward's input gradient and receives this forward's
input; a backward slot sends the previous forward's output and receives this backward's output
gradient. Each transfer is its own blocking ``dist.send`` / ``dist.recv`` (p2p.py). Before DeepSpeed
#2862 (2023) a forward slot received before it sent and a backward slot sent before it received; since
then, the other way round. Both orders are timed here.

A transfer is a rendezvous: both stages wait until both have posted it, then both are held for its
network time (``scoring.send_seconds``). The receiver then all-gathers a tensor that was sent in pieces
(the rest of ``scoring.cut_seconds``). Compute is the planner's per-stage forward and backward (its
``_stage_durations``), minus the transfers the planner added to them. The step ends with the last
stage's last action. The gradient sync and optimizer tail are left out: they are the same in both.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import literature  # noqa: E402
from autoshard.passes.pipeline.schedule.generators import prepared  # noqa: E402
from autoshard.passes.pipeline.schedule.simulate import StageCosts, simulate  # noqa: E402
from autoshard.passes.pipeline.stages import scoring  # noqa: E402


def train_slots(stage: int, p: int, m: int, before_2862: bool) -> list[tuple[str, int]]:
    """Stage ``stage``'s instruction stream: ("F" | "B" | "send_act" | "recv_act" | "send_grad" |
    "recv_grad", microbatch), slot by slot, for p stages and m microbatches, in the transfer order of
    DeepSpeed before #2862 (``before_2862``) or after it."""
    out, prev = [], -1
    for slot in range(2 * (m + p - 1)):
        forward = slot % 2 == stage % 2
        half = slot // 2
        if forward:
            mb = half - stage // 2
        elif stage % 2:
            mb = half - p + (stage + 1) // 2
        else:
            mb = (slot - 1) // 2 - p + 1 + stage // 2
        ok = 0 <= mb < m
        prev_ok = 0 <= prev < m
        if forward:
            send = [("send_grad", prev)] if prev_ok and stage > 0 else []
            recv = [("recv_act", mb)] if ok and stage > 0 else []
        else:
            send = [("send_act", prev)] if prev_ok and stage < p - 1 else []
            recv = [("recv_grad", mb)] if ok and stage < p - 1 else []
        out += recv + send if before_2862 == forward else send + recv
        if ok:
            out.append(("F" if forward else "B", mb))
        prev = mb
    return out


_PEER = {"send_act": (1, "recv_act"), "recv_act": (-1, "send_act"), "send_grad": (-1, "recv_grad"),
         "recv_grad": (1, "send_grad")}


def rendezvous_step(p: int, m: int, f: list, b: list, wire: list, gather: list, before_2862: bool) -> float:
    """Step time of ``train_slots`` on every stage. ``f`` / ``b``: compute per stage; ``wire[s]``: network
    seconds of a transfer across cut s (between stages s and s + 1); ``gather[s]``: what the receiver of
    that transfer spends after it (all-gathering the pieces)."""
    streams = [train_slots(s, p, m, before_2862) for s in range(p)]
    pos, clock = [0] * p, [0.0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(streams[s]):
                kind, mb = streams[s][pos[s]]
                if kind in ("F", "B"):
                    clock[s] += (f if kind == "F" else b)[s]
                    pos[s] += 1
                    moved = True
                    continue
                step, want = _PEER[kind]
                q = s + step
                if pos[q] >= len(streams[q]) or streams[q][pos[q]] != (want, mb):
                    break
                cut = min(s, q)
                end = max(clock[s], clock[q]) + wire[cut]
                clock[s] = clock[q] = end
                receiver = q if kind.startswith("send") else s
                clock[receiver] += gather[cut]
                pos[s] += 1
                pos[q] += 1
                moved = True
    if any(pos[s] < len(streams[s]) for s in range(p)):
        raise RuntimeError("DeepSpeed's schedule deadlocked under rendezvous transfers")
    return max(clock)


def planner_stage_costs(row) -> tuple:
    """(the planner's step, its StageProblem, cut starts, recompute) for ``row``, caught at its scoring."""
    seen = []
    original = scoring.score_stages

    def spy(prob, schedule, starts, recompute):
        result = original(prob, schedule, starts, recompute)
        seen.append((result[0], prob, list(starts), list(recompute)))
        return result
    patched = [mod for mod in list(sys.modules.values()) if getattr(mod, "score_stages", None) is original]
    for mod in patched:
        mod.score_stages = spy
    try:
        step = literature.price(row)["step"]
    finally:
        for mod in patched:
            mod.score_stages = original
    return min(seen, key=lambda x: abs(x[0] - step))[1:] + (step,)


def held_out_row_of_args():
    """The held-out row ``--row`` names (a substring of its name in ``literature.HELD_OUT``; default the 420-node run)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="420", help="substring of a held-out row's name (literature.HELD_OUT)")
    args = ap.parse_args()
    return next(r for r in literature.HELD_OUT if args.row in r.name)


def main() -> None:
    row = held_out_row_of_args()
    prob, starts, recompute, step = planner_stage_costs(row)
    f, b = scoring._stage_durations(prob, starts, recompute)
    p, m, L = len(starts), prob.m, len(prob.fwd)
    cuts = [e - 1 for e in starts[1:]]  # the unit before each stage cut
    send = prob.send_seconds or [0.0] * L
    wire = [send[u] for u in cuts]
    gather = [prob.cut_seconds[u] - send[u] for u in cuts]
    # strip the transfers the planner charged to each stage's forward and backward
    comp_f = [f[s] - (prob.cut_seconds[cuts[s - 1]] if s > 0 else 0.0) - (wire[s] if s < p - 1 else 0.0) for s in range(p)]
    comp_b = [b[s] - (prob.cut_seconds[cuts[s]] if s < p - 1 else 0.0) - (wire[s - 1] if s > 0 else 0.0) for s in range(p)]
    simulated = simulate(prepared("1f1b", p, m), StageCosts(f=f, b=b, w=[0.0] * p)).step_time
    print(f"{row.name}: p {p}, m {m}; planner step {step:.3f} s (its 1f1b schedule {simulated:.3f} s, then the "
          f"gradient sync and optimizer tail {step - simulated:.3f} s)")
    print(f"per stage F+B: first {f[0] + b[0]:.4f} s, middle {f[p // 2] + b[p // 2]:.4f} s, last {f[-1] + b[-1]:.4f} s; "
          f"a transfer's network time {wire[0] * 1e3:.2f} ms, the receiver's all-gather {gather[0] * 1e3:.2f} ms")
    for label, before in (("DeepSpeed before #2862 (2021, MT-NLG's time)", True), ("DeepSpeed after #2862", False)):
        t = rendezvous_step(p, m, comp_f, comp_b, wire, gather, before)
        print(f"{label}: {t:.3f} s, {t - simulated:+.3f} s against the planner's 1f1b schedule")


if __name__ == "__main__":
    main()
