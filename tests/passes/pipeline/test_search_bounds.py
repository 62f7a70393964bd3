"""The stage search skips simulations that cannot win, and its answer stays the same.

``_even_cuts`` simulates the even cut of every configuration whose closed form is near the best; a
cut whose busiest rank group's compute alone (``scoring.busiest_rank_seconds``) exceeds the best step
so far cannot replace it (only a strictly shorter step does), so it is not generated nor simulated.
Checked here: the bound is below every simulated step, and the search with the skip chooses exactly
what it chooses without it, with fewer simulations."""
from __future__ import annotations

import random

import pytest
import torch

import autoshard.passes.pipeline.stages.search as search_module
from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.scoring import (DEFAULT_SCHEDULES, accumulation_share, busiest_rank_seconds,
                                                       config_floor, score_stages,
                                                       step_floor)
from autoshard.passes.pipeline.stages.search import profile_candidates, search_stages
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch
from autoshard.passes.pipeline.stages.stage_problem import StageProblem
from autoshard.passes.solve.context import PlanContext
from autoshard.testing.models import GPT, lm_loss


def _problem(rng: random.Random, units: int, p: int, m: int, schedule: str) -> StageProblem:
    fwd = [rng.uniform(0.1, 2.0) for _ in range(units)]
    return StageProblem(
        fwd=fwd, bwd=[2 * f * rng.uniform(0.8, 1.2) for f in fwd], grad_sync=[rng.uniform(0, 0.5) for _ in fwd],
        state=[1.0] * units, act=[1.0] * units, cut_seconds=[rng.uniform(0, 0.3) for _ in fwd],
        cut_bytes=[1.0] * units, stage_group=get_schedule(schedule).stage_rank(p), held=[1] * units, m=m,
        memory_limit=1e30, holds_params=[True] * units, grads=[0.0] * units, opt_fixed=[0.0] * units,
        opt_peak=[0.0] * units, opt_step=[rng.uniform(0, 0.2) for _ in fwd])


def _random_shapes(schedule: str):
    """(p, m, stages, units) of five random cuts per pipeline shape the schedule accepts: three units
    more than stages, so the cuts differ."""
    sched = get_schedule(schedule)
    for p in (2, 4):
        for m in (4, 8, 12):
            if sched.accepts(p, m):
                for _ in range(5):
                    yield p, m, p * sched.virtual_stages, p * sched.virtual_stages + 3


def _random_cut(rng: random.Random, units: int, stages: int) -> tuple[list[int], list[bool]]:
    """Stage starts (the first at 0) and a recompute flag per stage, drawn at random."""
    starts = [0] + sorted(rng.sample(range(1, units), stages - 1))
    return starts, [rng.random() < 0.5 for _ in range(stages)]


@pytest.mark.parametrize("schedule", DEFAULT_SCHEDULES)
def test_the_busiest_rank_bound_is_below_every_simulated_step(schedule):
    rng = random.Random(7)
    checked = 0
    for p, m, stages, units in _random_shapes(schedule):
        prob = _problem(rng, units, p, m, schedule)
        starts, recompute = _random_cut(rng, units, stages)
        step = score_stages(prob, schedule, starts, recompute)[0]
        bound = busiest_rank_seconds(prob, schedule, starts, recompute)
        assert bound <= step * (1 + 1e-12), (p, m, starts)
        checked += 1
    assert checked >= 10


@pytest.fixture(scope="module")
def small_gpt_profiles():
    """(mesh, candidate profiles) of a small GPT on (8,), pp 2/4/8: a head worth a few blocks, so the even
    cut's last stage is the busiest and many even cuts cannot win (shared by the search tests)."""
    with torch.device("meta"):
        model = GPT(7680, 256, 8, 4, 128, False)
    ids = torch.empty(64, 128, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())
    mesh = Mesh((8,))
    return mesh, profile_candidates(captured, mesh, [2, 4, 8], PlanContext.of("h100", optimizer="adamw"),
                                    PipelineSearch())


def _choice_key(best):
    return (best.pp, tuple(best.profile.mesh.shape), best.m, best.schedule, tuple(best.stages.starts),
            tuple(best.stages.recompute), best.step_time)


def test_even_cuts_skip_what_cannot_win_and_choose_the_same(monkeypatch, small_gpt_profiles):
    mesh, profiles = small_gpt_profiles
    ctx = PlanContext.of("h100", time_limit_s=4.0)
    best, stats = search_stages(profiles, mesh, ctx, 64)
    monkeypatch.setattr(search_module, "_cannot_beat", lambda *a: False)
    every, every_stats = search_stages(profiles, mesh, ctx, 64)
    assert _choice_key(best) == _choice_key(every)
    assert stats["ilp"] == every_stats["ilp"] and stats["work_s"] == every_stats["work_s"]
    assert stats["even"] < every_stats["even"], (stats["even"], every_stats["even"])


@pytest.mark.parametrize("schedule", DEFAULT_SCHEDULES)
def test_the_step_floor_is_below_every_simulated_step_and_above_the_config_floor(schedule):
    # the floor adds each group's optimizer step (what follows its backward) to its compute; the
    # configuration's floor is the average group's, below every cut's
    from autoshard.passes.pipeline.stages.layer_costs import UnitCost
    rng = random.Random(11)
    checked = tighter = 0
    for p, m, stages, units in _random_shapes(schedule):
        costs = [UnitCost(fwd_fixed=rng.uniform(0, 0.05), fwd_batch=rng.uniform(0.1, 2.0) * m,
                          bwd_batch=rng.uniform(0.2, 4.0) * m, opt_step=rng.uniform(0, 0.5),
                          accumulate=rng.uniform(0, 0.05)) for _ in range(units)]
        prob = _problem(rng, units, p, m, schedule)
        # as ``stage_problem`` builds them: accumulations inside the backwards, the update after
        prob.fwd = [c.fwd(m) for c in costs]
        prob.bwd = [c.bwd(m) + accumulation_share(c, m) for c in costs]
        prob.cut_seconds = [0.0] * units
        prob.opt_step = [c.opt_step for c in costs]
        starts, recompute = _random_cut(rng, units, stages)
        step = score_stages(prob, schedule, starts, recompute)[0]
        floor = step_floor(prob, schedule, starts, recompute)
        assert config_floor(costs, p, m) <= floor * (1 + 1e-12), (p, m, starts)
        assert floor <= step * (1 + 1e-12), (p, m, starts)
        tighter += floor > busiest_rank_seconds(prob, schedule, starts, recompute)
        checked += 1
    assert checked >= 10 and tighter == checked


def test_the_optimizer_step_floor_skips_more_and_chooses_the_same(monkeypatch, small_gpt_profiles):
    # the floors with each group's optimizer step prune configurations and even cuts that the compute
    # bound alone lets through; the answer must not move
    mesh, profiles = small_gpt_profiles
    ctx = PlanContext.of("h100", time_limit_s=4.0)
    best, stats = search_stages(profiles, mesh, ctx, 64)
    monkeypatch.setattr(search_module, "_below", lambda best, bound, floor: best is not None and bound >= best.step_time)
    monkeypatch.setattr(search_module, "step_floor", busiest_rank_seconds)
    old, old_stats = search_stages(profiles, mesh, ctx, 64)
    assert _choice_key(best) == _choice_key(old)
    assert stats["work_s"] <= old_stats["work_s"]
    done = stats["simulated"] + stats["even"] + stats["ilp"]
    old_done = old_stats["simulated"] + old_stats["even"] + old_stats["ilp"]
    assert done < old_done, (stats, old_stats)


def _compute_and_update_floor(prob, schedule, starts, recompute):
    """The floor before the start and tail terms: the busiest group's compute plus its optimizer step."""
    from autoshard.passes.pipeline.stages.scoring import _stage_durations
    ends = list(starts[1:]) + [len(prob.fwd)]
    busy: dict = {}
    for s, ((f, b), a, e) in enumerate(zip(zip(*_stage_durations(prob, starts, recompute)), starts, ends)):
        g = prob.stage_group[s]
        busy[g] = busy.get(g, 0.0) + prob.m * (f + b) + sum(prob.opt_step[a:e])
    return max(busy.values())


@pytest.mark.parametrize("schedule", DEFAULT_SCHEDULES)
def test_the_pipeline_floor_counts_the_wait_and_the_tail_and_stays_below_the_step(schedule):
    # the floor adds, per group, the forwards before its first stage and (joint backwards) the
    # backwards below it: the pipeline's fill and drain as that group sees them
    rng = random.Random(23)
    v = get_schedule(schedule).virtual_stages
    checked = tighter = 0
    for p in (2, 3, 4):
        for m in (1, 4, 8, 12):
            if not get_schedule(schedule).accepts(p, m):
                continue
            stages = p * v
            units = stages + 3
            for _ in range(6):
                prob = _problem(rng, units, p, m, schedule)
                starts, recompute = _random_cut(rng, units, stages)
                step = score_stages(prob, schedule, starts, recompute)[0]
                floor = step_floor(prob, schedule, starts, recompute)
                old = _compute_and_update_floor(prob, schedule, starts, recompute)
                assert old <= floor * (1 + 1e-12), (p, m, starts)
                assert floor <= step * (1 + 1e-12), (p, m, starts, floor, step)
                tighter += floor > old * (1 + 1e-9)
                checked += 1
    assert checked >= 10 and tighter >= checked // 2, (tighter, checked)


def test_the_pipeline_floor_skips_more_even_cuts_and_chooses_the_same(monkeypatch, small_gpt_profiles):
    mesh, profiles = small_gpt_profiles
    ctx = PlanContext.of("h100", time_limit_s=4.0)
    best, stats = search_stages(profiles, mesh, ctx, 64)
    monkeypatch.setattr(search_module, "step_floor", _compute_and_update_floor)
    old, old_stats = search_stages(profiles, mesh, ctx, 64)
    assert _choice_key(best) == _choice_key(old)
    assert stats["ilp"] == old_stats["ilp"] and stats["work_s"] == old_stats["work_s"]
    assert stats["even"] < old_stats["even"], (stats["even"], old_stats["even"])
