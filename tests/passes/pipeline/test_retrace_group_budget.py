"""compile's per-stage re-solve (``stages/retrace.py``) bounds a rank group of several stages as the stage
planner did: at the schedule's worst moment (``group_peak``), not by the sum of its stages' own peaks.

The plan: a meta GPT on 2 H100s, pp 2 x 4 virtual stages (interleaved 1F1B), 8 microbatches (its
schedule and groups; the second test gives its stages made-up memory records, whose stages summed at each
one's own worst count need far more than the group holds at its worst moment). A stage re-solved under a
limit between the two is kept when its group's peak fits; the old rule (the limit less
the other stages' own peaks) re-solved it under lower walk limits, and below what a walk needs raised
``InfeasiblePlanError`` (``test_pipeline_auto``'s tight-memory case, with the even pass checking moments).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autoshard
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.pipeline.group_peak import group_peaks, memory_record
from autoshard.passes.pipeline.stages import retrace
from autoshard.testing.models import GPT, lm_loss


@pytest.fixture(scope="module")
def plan():
    with torch.device("meta"):
        model = GPT(vocab=32000, d=256, n_layer=6, n_head=8, seq=128, tied=False)
    ids = torch.empty(16, 128, dtype=torch.long, device="meta")
    return autoshard.plan(model, 2, pp=2, schedule="interleaved-1f1b-v4", microbatches=8, example_inputs=(ids,),
                          loss_fn=lm_loss, example_target=ids, hardware="h100")


def _own_peaks(plan, group):
    return sum(float(s.solution.estimated_memory) for s in plan.stages if s.group == group)


def test_a_stage_is_priced_in_its_groups_peak_at_the_worst_moment(plan):
    assert plan.virtual == 4 and len(plan.stages) == 8
    peaks = group_peaks([(s.index, s.group, s.solution.estimated, s.solution.estimated_memory) for s in plan.stages],
                        plan.schedule, plan.pp, plan.microbatches)
    for s in plan.stages:
        assert retrace._group_peak(plan, s.index, s.solution, {}) == peaks[s.group]
    # a stage re-solved leaner lowers its group's peak, and only its group's
    s = plan.stages[1]
    leaner = replace(s.solution, estimated={**s.solution.estimated,
                                            "stage_idle_bytes": s.solution.estimated["stage_idle_bytes"] - 1000.0})
    assert retrace._group_peak(plan, 1, leaner, {}) == peaks[s.group] - 1000.0
    # the first walk limit leaves the others' idle bytes, never less than the old rule's
    for s in plan.stages:
        others = _own_peaks(plan, s.group) - float(s.solution.estimated_memory)
        assert retrace._stage_budget(plan, s.index, 1e12, {}) >= 1e12 - others


def test_a_stage_that_fits_only_at_the_groups_worst_moment_is_kept(plan):
    """Every stage keeps 100 B, 10 B per held microbatch and works with 1,000 B (its own peak 2,000 B):
    a group of 4 stages peaks at 400 + 10 k + 1,000 B at its worst moment, far below the 8,000 B of its
    stages' own peaks. Under that limit a stage as planned fits and is solved once; by its own peak
    against the limit less the others' own peaks (the old rule, below 0 here) it could not fit."""
    record = memory_record(idle=100, per_microbatch=10, running=1000, optimizer=150)
    stages = [replace(s, solution=replace(s.solution, estimated=dict(record), estimated_memory=2000.0))
              for s in plan.stages]
    small = plan.with_stages(stages, captured=plan.captured)
    i, group = 2, stages[2].group
    limit = retrace._group_peak(small, i, stages[i].solution, {})
    assert 1400 < limit < 1500
    old_budget = limit - (_own_peaks(small, group) - 2000.0)
    assert old_budget < 2000.0  # premise: the old rule rejects the stage as planned
    walks = []

    def solve(walk_limit):
        walks.append(walk_limit)
        if walk_limit < 100:
            raise InfeasiblePlanError("below what one microbatch's walk needs")
        return stages[i].solution

    budget = retrace._stage_budget(small, i, limit, {})
    assert budget == limit - 300  # the others' idle bytes
    got = retrace._fitted_stage(solve, lambda sol: sol, budget, lambda sol: retrace._group_peak(small, i, sol, {}), limit)
    assert got is stages[i].solution and walks == [budget]
