"""``prepared`` compiles a generated schedule from the global sequence ``with_comms`` read it off,
checked in one pass, instead of dry-running it a second time: the result must time exactly as the
full dry run's, the dry run must not run, and a corrupted schedule or order must still raise."""
from __future__ import annotations

import random

import pytest

import autoshard.passes.pipeline.schedule.simulate as simulate_module
from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.generators import _generated, prepared
from autoshard.passes.pipeline.schedule.registry import get_schedule, searched_schedules
from autoshard.passes.pipeline.schedule.simulate import (DeadlockError, ScheduleError, StageCosts, prepare,
                                                         simulate)

# the searched schedules, and the interleaved family up to v = 8
NAMES = sorted(set(searched_schedules()) | {f"interleaved-1f1b-v{v}" for v in range(2, 9)})
FIELDS = ("n_stages", "ranks", "actions", "prev", "deps", "peak_stage", "peak_rank")


def _grid(name: str):
    desc = get_schedule(name)
    for p in (1, 2, 3, 4):
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p + 1}):
            if m >= 1 and desc.accepts(p, m):
                yield p, m


def _costs(rng: random.Random, n: int) -> StageCosts:
    return StageCosts([rng.uniform(0.1, 2) for _ in range(n)], [rng.uniform(0.1, 2) for _ in range(n)],
                      [rng.uniform(0, 1) for _ in range(n)], latency=rng.choice([0.0, rng.uniform(0, 0.5)]))


def _count_dry_runs(monkeypatch) -> list:
    calls = []
    real = simulate_module.dry_run

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(simulate_module, "dry_run", counted)
    return calls


def test_fast_path_times_every_searched_schedule_as_the_dry_run(monkeypatch):
    rng = random.Random(7)
    runs = _count_dry_runs(monkeypatch)
    checked = 0
    for name in NAMES:
        for p, m in _grid(name):
            sched, order = _generated(name, p, m, None)
            runs.clear()
            fast = prepare(sched, order)
            assert not runs, f"{name} p={p} m={m}: the claimed order was rejected"
            slow = prepare(sched)
            assert runs
            for f in FIELDS:
                assert getattr(fast, f) == getattr(slow, f), (name, p, m, f)
            assert sorted(fast.order) == list(range(len(fast.actions)))
            for _ in range(2):
                costs = _costs(rng, fast.n_stages)
                assert simulate(fast, costs) == simulate(slow, costs), (name, p, m)
            checked += 1
    assert checked > 100


def test_prepared_runs_one_dry_run_not_two(monkeypatch):
    prepared.cache_clear()
    runs = _count_dry_runs(monkeypatch)
    prep = prepared("interleaved-1f1b-v3", 4, 9)
    assert len(runs) == 1  # the compute-only run with_comms times; none on the full schedule
    costs = StageCosts(1.0, 2.0, 0.5, latency=0.1)
    assert simulate(prep, costs) == simulate(prepare(_generated("interleaved-1f1b-v3", 4, 9, None)[0]), costs)
    prepared.cache_clear()


def _swap_on_rank(sched: dict, rank: int, kind_a: str, kind_b: str) -> dict:
    """A copy with the first ``kind_a`` action of ``rank`` swapped with the first ``kind_b`` after it."""
    out = {r: list(acts) for r, acts in sched.items()}
    acts = out[rank]
    i = next(j for j, a in enumerate(acts) if a.kind == kind_a)
    k = next(j for j in range(i + 1, len(acts)) if acts[j].kind == kind_b)
    acts[i], acts[k] = acts[k], acts[i]
    return out


def test_a_corrupted_generated_schedule_still_raises():
    sched, order = _generated("1f1b", 3, 4, None)
    # a RECV moved after the compute that needs it: the claimed order breaks, the dry run names it
    broken = _swap_on_rank(sched, 1, "RECV_F", "F")
    with pytest.raises(DeadlockError) as fast:
        prepare(broken, order)
    with pytest.raises(DeadlockError) as slow:
        prepare(broken)
    assert str(fast.value) == str(slow.value)
    # a missing compute action (and its order entry): incomplete, as the dry run says
    dropped = {r: [a for a in acts if a != Action(0, "BW", 3)] for r, acts in sched.items()}
    short = [(r, i - (r == 0 and i > sched[0].index(Action(0, "BW", 3))))
             for r, i in order if (r, i) != (0, sched[0].index(Action(0, "BW", 3)))]
    with pytest.raises(ScheduleError, match="incomplete"):
        prepare(dropped, short)
    # a duplicated action
    doubled = {r: list(acts) for r, acts in sched.items()}
    doubled[2].append(Action(2, "BW", 0))
    with pytest.raises(ScheduleError, match="twice"):
        prepare(doubled, order + [(2, len(sched[2]))])
    # transfers out of FIFO order between one pair of ranks
    fifo = _swap_on_rank(sched, 1, "RECV_F", "RECV_F")
    with pytest.raises(DeadlockError, match="match in order"):
        prepare(fifo, order)


def test_a_wrong_order_for_a_valid_schedule_falls_back_to_the_dry_run(monkeypatch):
    sched, order = _generated("zbv", 2, 4, None)
    runs = _count_dry_runs(monkeypatch)
    for bad in (list(reversed(order)), order[:-1], order[:-1] + [order[0]], order[:-1] + [(9, 0)]):
        runs.clear()
        prep = prepare(sched, bad)
        assert runs  # the claim failed its check, so the schedule was dry-run
        assert simulate(prep, StageCosts(1, 2, 3)) == simulate(sched, StageCosts(1, 2, 3))
