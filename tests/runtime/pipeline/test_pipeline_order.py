"""Transfer order of the pipeline runtime: NCCL-safe by construction, checked without processes.

NCCL ignores tags: between two ranks it hands the n-th receive the n-th send, and a send may hold its
pair's stream until the receive is posted. For every generated schedule (gpipe, 1f1b,
interleaved-1f1b, zb-h1, zbv, dualpipev) and several (pp, m), on a chain of stages and on a wiring
with a long skip connection, two fan-outs and an integer value, this test builds the Interpreter's
own per-action tables (``Interpreter.steps``: the receives each rank posts before each action and the
sends after it, with ranks and tags) and checks, per ordered pair of ranks:

- the sends issued are exactly the receives posted, message for message, in the same order, and
  every cross-rank transfer the wiring implies appears once;
- every send comes after the action that produces it;
- replaying all ranks with NCCL's matching (the n-th posted receive gets the n-th send) completes with
  every receive getting the message it expects, also with receives posted 1 or 3 actions early
  (the gloo prefetch);
- the worst case also completes: one stream per pair, a send or receive finishing only together with
  its partner, each op waiting for the compute issued before it (``_rendezvous``);
- tags are unique per pair (gloo matches by tag).

Negative controls show the checks can fail: posting each receive just before its consumer (the old
runtime) gets wrong tensors under FIFO matching on V schedules and deadlocks 1F1B under rendezvous.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.generators import SCHEDULE_NAMES, generate, stage_rank
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.runtime.pipeline.interpreter import Interpreter, executed_schedule
from autoshard.runtime.pipeline.p2p import Message, Wiring, action_messages, plan_transfers

CASES = [(2, 4), (3, 6), (4, 4), (4, 8), (4, 12), (2, 2), (3, 9), (3, 4), (4, 6)]  # the last two: m not a multiple of p
META = ((2, 3), torch.float32)


def _wiring(group_of: list[int], m: int, *, skips: bool) -> Wiring:
    """Stage s sends one float value to s+1. With ``skips``: stage 0 also sends a second float value to
    stages 1 and n-1 (a long skip, two readers) and an integer value to stage n-1 (no gradient back),
    and stage 1 sends its value to both stage 2 and stage n-1 when n > 3."""
    n = len(group_of)
    values, sends, receives, meta = [], {s: [] for s in range(n)}, {s: [] for s in range(n)}, []

    def add(producer: int, consumers: list[int], dtype=torch.float32):
        v = len(values)
        values.append((f"v{v}", producer))
        meta.append(((2, 3), dtype))
        sends[producer].append((v, consumers))
        for c in consumers:
            receives[c].append(v)

    for s in range(n - 1):
        readers = [s + 1]
        if skips and s == 1 and n > 3:
            readers.append(n - 1)
        add(s, readers)
    if skips and n > 2:
        add(0, [1, n - 1])
        add(0, [n - 1], torch.int64)
    groups = sorted(set(group_of))
    return Wiring(list(group_of), {g: [g] for g in groups}, values, sends, receives, meta, m)


def _schedules():
    for name in SCHEDULE_NAMES:
        for p, m in CASES:
            v = get_schedule(name).virtual_stages
            if not get_schedule(name).accepts(p, m):
                continue
            yield name, p, m, v


def _tables(name: str, p: int, m: int, v: int, skips: bool):
    sched = generate(name, p, m, v)
    group_of = stage_rank(name, p, v)
    w = _wiring(group_of, m, skips=skips)
    stubs = {g: {s: None for s, gg in enumerate(group_of) if gg == g} for g in sched}
    interps = {g: Interpreter(stubs[g], w, g, 0, g, torch.device("cpu"), sched) for g in sched}
    return sched, w, interps


def _replay(interps: dict, prefetch: int) -> None:
    """Run every rank's tables with NCCL's matching: the n-th receive a rank posts from a peer gets the
    n-th send that peer issues to it. Sends never block; an action waits until each remote input's
    receive is matched to a send. Fails on a wrong match or a deadlock."""
    fifo: dict[tuple[int, int], list[Message]] = {}
    slot: dict[int, dict] = {g: {} for g in interps}     # message -> (pair, index) at post time
    count: dict[tuple[int, int], int] = {}
    pc = dict.fromkeys(interps, 0)
    n_posted = dict.fromkeys(interps, 0)
    while not all(pc[g] == len(it.steps) for g, it in interps.items()):
        moved = False
        for g, it in interps.items():
            steps = it.steps
            if pc[g] == len(steps):
                continue
            while n_posted[g] < len(steps) and n_posted[g] <= pc[g] + prefetch:
                for msg, _, _, src, _ in steps[n_posted[g]].posts:
                    k = count.get((src, g), 0)
                    count[(src, g)] = k + 1
                    slot[g][msg] = ((src, g), k)
                n_posted[g] += 1
            step = steps[pc[g]]
            ok = True
            for msg, _, src in step.needs:
                if src is None:
                    continue
                assert msg in slot[g], f"rank {g} runs {step.action} without having posted a receive for {msg}"
                pair, k = slot[g][msg]
                if k >= len(fifo.get(pair, [])):
                    ok = False
                    break
                assert fifo[pair][k] == msg, (f"rank {g}'s receive #{k} from rank {pair[0]} expects {msg} but FIFO "
                                              f"matching hands it {fifo[pair][k]}")
            if not ok:
                continue
            for msg, dst, _ in step.sends:
                fifo.setdefault((g, dst), []).append(msg)
            pc[g] += 1
            moved = True
        assert moved, f"deadlock: ranks stuck at {[(g, str(interps[g].steps[pc[g]].action)) for g in pc if pc[g] < len(interps[g].steps)]}"
    for pair, q in fifo.items():
        assert count.get(pair, 0) == len(q), f"{pair}: {len(q)} sends, {count.get(pair, 0)} receives"


def _rendezvous(interps: dict) -> bool:
    """Whether the ranks' programs complete under NCCL's worst case: each rank's ops with one peer run
    in issue order on one stream, a send or receive completes only together with its partner (no
    buffering), each op also waits for the compute issued before it, and an action waits for its
    receives. True when every op completes."""
    ops, streams, partner = [], {}, {}
    for g, it in interps.items():
        last_compute, recv_of = None, {}
        for step in it.steps:
            for msg, _, _, src, _ in step.posts:
                q = streams.setdefault((g, src), [])
                ops.append({"after": [x for x in (q[-1] if q else None, last_compute) if x is not None]})
                recv_of[msg] = len(ops) - 1
                partner[("r", src, g, msg)] = len(ops) - 1
                q.append(len(ops) - 1)
            needs = [recv_of[msg] for msg, _, src in step.needs if src is not None]
            ops.append({"after": needs + ([last_compute] if last_compute is not None else [])})
            last_compute = len(ops) - 1
            for msg, dst, _ in step.sends:
                q = streams.setdefault((g, dst), [])
                ops.append({"after": [x for x in (q[-1] if q else None, last_compute) if x is not None]})
                partner[("s", g, dst, msg)] = len(ops) - 1
                q.append(len(ops) - 1)
    pair_of = {}
    for (kind, src, dst, msg), o in partner.items():
        if kind == "s":
            other = partner[("r", src, dst, msg)]
            pair_of[o], pair_of[other] = other, o
    done = [False] * len(ops)
    ready = lambda o: all(done[x] for x in ops[o]["after"])  # noqa: E731
    moved = True
    while moved:
        moved = False
        for o in range(len(ops)):
            if done[o] or not ready(o):
                continue
            if o in pair_of:
                if not ready(pair_of[o]):
                    continue
                done[pair_of[o]] = True
            done[o] = moved = True
    return all(done)


@pytest.mark.parametrize("skips", [False, True], ids=["chain", "skips"])
def test_send_order_equals_receive_order(skips):
    checked = 0
    for name, p, m, v in _schedules():
        sched, w, interps = _tables(name, p, m, v, skips)
        compute = executed_schedule(sched)
        sent: dict[tuple[int, int], list] = {}
        received: dict[tuple[int, int], list] = {}
        for g, it in interps.items():
            made = set()
            assert [s.action for s in it.steps] == compute[g]
            for step in it.steps:
                for msg, _, _, src, _ in step.posts:
                    received.setdefault((src, g), []).append(msg)
                for msg, dst in action_messages(step.action, w)[1]:
                    made.add(msg)
                for msg, dst, tag in step.sends:
                    assert msg in made, f"{name} p={p} m={m}: rank {g} sends {msg} before producing it"
                    sent.setdefault((g, dst), []).append((msg, tag))
        assert sent.keys() == received.keys(), f"{name} p={p} m={m}"
        for pair, msgs in sent.items():
            assert [mm for mm, _ in msgs] == received[pair], f"{name} p={p} m={m}: order differs on {pair}"
            assert len({t for _, t in msgs}) == len(msgs), f"{name} p={p} m={m}: tags repeat on {pair}"
            assert len(set(received[pair])) == len(received[pair])
        # every cross-rank transfer the wiring implies is sent exactly once
        expected = set()
        for g, acts in compute.items():
            for a in acts:
                for msg, src in action_messages(a, w)[0]:
                    if w.group_of[src] != g:
                        expected.add((w.group_of[src], g, msg))
        assert {(s, d, mm) for (s, d), msgs in sent.items() for mm, _ in msgs} == expected
        for prefetch in (0, 1, 3):
            _replay(interps, prefetch)
        assert _rendezvous(interps), f"{name} p={p} m={m}: deadlocks if sends wait for their receives"
        checked += 1
    assert checked >= 30


def test_posting_receives_at_consumption_breaks_fifo():
    """The shared order matters: on V schedules a rank produces messages for a peer in another order
    than the peer consumes them, so a runtime posting each receive just before its consumer (tags
    decide on gloo, but NCCL matches by order) would get the wrong tensors. The replay sees it; the
    rendezvous model (one stream per pair, blocking sends) also deadlocks plain 1F1B that way."""
    hits = 0
    for name in ("zbv", "dualpipev"):
        _, w, interps = _tables(name, 4, 8, 2, skips=False)
        for g, it in interps.items():
            it.steps = [dataclasses.replace(st, posts=tuple((msg, *w.meta[msg.value], src, w.tag(msg))
                                                            for msg, _, src in st.needs if src is not None))
                        for st in it.steps]
        with pytest.raises(AssertionError, match="FIFO matching hands"):
            _replay(interps, 0)
        hits += 1
    _, w, interps = _tables("1f1b", 4, 8, 1, skips=False)
    assert _rendezvous(interps)
    for g, it in interps.items():
        it.steps = [dataclasses.replace(st, posts=tuple((msg, *w.meta[msg.value], src, w.tag(msg))
                                                        for msg, _, src in st.needs if src is not None))
                    for st in it.steps]
    _replay(interps, 0)  # FIFO order is the same for 1F1B...
    assert not _rendezvous(interps)  # ...but a blocking send then waits on its own reply
    assert hits == 2


def test_plan_rejects_incomplete_schedule():
    sched = generate("1f1b", 2, 2)
    w = _wiring(stage_rank("1f1b", 2), 2, skips=False)
    compute = executed_schedule(sched)
    compute[1] = [a for a in compute[1] if a != Action(1, "F", 1)]
    with pytest.raises(RuntimeError, match="none of its actions consumes"):
        plan_transfers(compute, w)
    compute = executed_schedule(sched)
    compute[0] = [a for a in compute[0] if a != Action(0, "F", 1)]
    with pytest.raises(RuntimeError, match="cannot all run"):
        plan_transfers(compute, w)
    with pytest.raises(RuntimeError, match="does not run"):
        plan_transfers({0: [Action(1, "F", 0)], 1: []}, w)
