"""More memory never makes the stage planner's answer infeasible (``stage_fit``), and when nothing fits
the message's "needs" is what the busiest rank group needs (``stage_cuts.leanest_memory``).

One process. The sweep is the case that broke: a GPT with pp = 2 on (2, 2), two ranks per node,
planned at 330 KB and 360 KB but not at 400 KB (the intra-op plan at the looser budget kept weights
replicated that no stage cut could hold)."""
import dataclasses
import itertools
import math

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.pipeline.stages import stage_fit
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.stage_cuts import leanest_memory
from autoshard.passes.pipeline.stages.stage_problem import StageProblem, group_memory, stage_memory_terms
from autoshard.testing.models import gpt
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext

#: the limits of the case that broke (KB), and two past them
LIMITS = [330_000, 360_000, 400_000, 420_000, 440_000]


def two_per_node():
    """Two ranks per node on a fast link, nodes joined by a 1 MB/s one (the pipeline crosses nodes)."""
    return dataclasses.replace(get_hardware("cpu"), name="two-per-node", devices_per_node=2,
                               inter_node_bandwidth=1e6, inter_node_latency=1e-3, intra_node_bandwidth=1e11,
                               intra_node_latency=1e-6)


@pytest.fixture(scope="module")
def sweep():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(n_layer=4, d=32, n_head=2, seq=8)
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    out = {}
    for limit in LIMITS:
        try:
            out[limit] = plan_pipeline(captured, (2, 2),
                                       PlanContext.of(two_per_node(), memory_limit=limit, time_limit_s=60.0),
                                       PipelinePins(pp=2))
        except InfeasiblePlanError as e:
            out[limit] = e
    return out


def test_more_memory_never_makes_the_pipeline_infeasible(sweep):
    feasible = [not isinstance(sweep[limit], Exception) for limit in LIMITS]
    assert feasible[0], f"premise: the case plans at {LIMITS[0]} bytes: {sweep[LIMITS[0]]}"
    assert all(feasible), {limit: str(sweep[limit])[:200] for limit, ok in zip(LIMITS, feasible) if not ok}
    for limit in LIMITS:
        plan = sweep[limit]
        assert plan.pp == 2 and max(s.solution.estimated_memory for s in plan.stages) <= limit * (1 + 1e-9)


@pytest.mark.xfail(strict=True, reason="the intra-op plan of every (pp, submesh) candidate minimises a proxy (one "
                   "microbatch's time under pp x the limit), not the pipeline's step, so a looser limit can pick a plan "
                   "that pipelines worse (440 KB: zb-h1 m=4, 0.0230 s; 420 KB: zb-h1 m=2, 0.0200 s). Only evaluating "
                   "nested sets of intra-op plans by the simulated step would make the step monotone")
def test_more_memory_never_makes_the_step_slower(sweep):
    steps = [sweep[limit].step_time for limit in LIMITS]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:])), dict(zip(LIMITS, steps))


# ---- the re-plan loop, on stand-in plans ----------------------------------------------------------------

class _Plan:
    def __init__(self, budget, status="OPTIMAL"):
        self.budget = budget
        self.solver_stats = {"status": status}


def _planner(fits_below: float, calls: list):
    """``plan(budget)`` whose plan needs budget / 2 per group; the least-memory plan (budget 0) needs 10."""
    def plan(budget):
        calls.append(budget)
        sol = _Plan(budget, "MEMORY_FALLBACK" if budget == 0 else "OPTIMAL")
        return sol, sol

    def check(prof):
        need = 10.0 if prof.budget == 0 else prof.budget / 2
        return (1.0 if prof.budget <= fits_below else math.inf), need
    return plan, check


def test_a_plan_that_fits_is_planned_once():
    calls = []
    plan, check = _planner(fits_below=1000, calls=calls)
    sol, _, tries = stage_fit.fitting_profile(plan, 800, check, memory_limit=400)
    assert calls == [800] and tries == [] and sol.budget == 800


def test_an_unfit_plan_is_planned_again_under_a_budget_shrunk_by_its_overshoot():
    calls = []
    plan, check = _planner(fits_below=750, calls=calls)
    sol, _, tries = stage_fit.fitting_profile(plan, 1000, check, memory_limit=400)
    # need 500 > 400: x min(SHRINK, 400 / 500) = 0.8; need 400 = the limit, yet no cut fits: x SHRINK
    assert calls == [1000, 800, 720]
    assert sol.budget == 720 and [t["fits"] for t in tries] == [False, True]


def test_nothing_fits_then_the_least_memory_plan_and_the_leanest_is_kept():
    calls = []
    plan, check = _planner(fits_below=-1, calls=calls)
    sol, _, tries = stage_fit.fitting_profile(plan, 1000, check, memory_limit=400)
    assert len(calls) == 2 + stage_fit.REPLANS and calls[-1] == 0
    assert sol.budget == 0  # needs 10: the leanest of all
    assert [t["fits"] for t in tries] == [False] * (1 + stage_fit.REPLANS)


# ---- what the infeasible message says it needs -----------------------------------------------------------

def test_leanest_memory_is_the_busiest_groups_sum_with_each_stage_at_its_leaner_recompute():
    # 4 units, 2 groups x 2 virtual stages: each stage alone is below the limit, each group is not
    prob = StageProblem(fwd=[1.0] * 4, bwd=[2.0] * 4, grad_sync=[0.0] * 4, state=[10.0, 12.0, 11.0, 13.0],
                        act=[5.0, 1.0, 6.0, 2.0], cut_seconds=[0.0] * 3, cut_bytes=[3.0, 4.0, 2.0],
                        stage_group=[0, 1, 0, 1], held=[3, 2, 2, 1], m=4, memory_limit=30.0)
    starts = [0, 1, 2, 3]
    brute = min(max(group_memory(prob, starts, list(r)).values()) for r in itertools.product((False, True), repeat=4))
    assert leanest_memory(prob, starts) == pytest.approx(brute)
    alone = [min(stage_memory_terms(prob, s, s + 1, r, s)[0] for r in (False, True)) for s in range(4)]
    assert max(alone) <= prob.memory_limit < leanest_memory(prob, starts), (alone, leanest_memory(prob, starts))


def test_the_infeasible_message_names_what_the_busiest_group_needs():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(n_layer=4, d=32, n_head=2, seq=8)
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    with pytest.raises(InfeasiblePlanError, match="leanest configuration tried needs") as err:
        plan_pipeline(captured, (2, 2), PlanContext.of(two_per_node(), memory_limit=200_000, time_limit_s=60.0),
                      PipelinePins(pp=2))
    need = float(str(err.value).split("needs ")[1].split(" KiB")[0]) * 1024
    assert need > 200_000, f"the message says {need:.0f} bytes fit under the limit of 200000: {err.value}"


# ---- the stages re-solved at the microbatch: their whole-step peak within the limit ---------------------

def test_a_stage_re_solved_at_the_microbatch_keeps_its_whole_step_peak_within_the_limit():
    """``replan_at_microbatch`` used to bound one microbatch's walk only: at 400 KB the last stage's
    walk fit (382 KB) and its peak with the schedule's in-flight microbatches did not (493 KB)."""
    from autoshard.passes.pipeline.stages.retrace import replan_at_microbatch
    from autoshard.passes.solve.context import PlanContext
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(n_layer=4, d=32, n_head=2, seq=8)
    full = capture(model, inputs, loss_fn=loss_fn, target=target)
    limit = 400_000
    plan = plan_pipeline(full, (2, 2), PlanContext.of(two_per_node(), memory_limit=limit, time_limit_s=60.0),
                         PipelinePins(pp=2))
    k = inputs[0].shape[0] // plan.microbatches
    small = capture(model, (inputs[0][:k],), loss_fn=loss_fn, target=target[:k])
    staged = replan_at_microbatch(plan, full, small, PlanContext.of(two_per_node(), limit, time_limit_s=20))
    peaks = [s.solution.estimated_memory for s in staged.stages]
    walks = [s.solution.estimated["microbatch_peak_bytes"] for s in staged.stages]
    assert all(w < p for w, p in zip(walks, peaks)), "premise: the stage peak adds to the walk"
    assert max(peaks) <= limit, peaks
