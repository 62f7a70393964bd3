"""A rank group holding several stages is priced at the schedule's worst moment, one stage running
(``schedule.held_moments``, ``pipeline.group_peak``, the stage ILP's (3'')). Measured against
MemTracker in ``tests/runtime/pipeline/test_pipeline_memory_peak.py`` (slow)."""
from __future__ import annotations

import pytest

from autoshard.passes.pipeline.group_peak import group_peaks, memory_record
from autoshard.passes.pipeline.schedule.generators import held_per_stage
from autoshard.passes.pipeline.schedule.held_moments import held_moments
from autoshard.passes.pipeline.stages.stage_ilp import solve_stages
from autoshard.passes.pipeline.stages.stage_problem import StageProblem, group_memory
from autoshard.passes.pipeline.schedule.registry import get_schedule


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 4, 8), ("interleaved-1f1b", 2, 4), ("interleaved-1f1b", 4, 8),
                                          ("interleaved-1f1b-v3", 4, 8), ("zbv", 4, 8), ("zb-h1", 4, 8)])
def test_moments_reach_each_stages_own_worst_count_and_no_more(schedule, p, m):
    """Every stage reaches its simulator count (``held_per_stage``) at some moment; no moment has a
    stage above it; a group never holds more than its stages' worst counts summed."""
    moments, worst = held_moments(schedule, p, m), held_per_stage(schedule, p, m)
    for group, mine in enumerate(moments):
        seen: dict = {}
        for _, counts in mine:
            for s, k in counts:
                assert k <= worst[s]
                seen[s] = max(seen.get(s, 0), k)
        assert seen == {s: worst[s] for s, g in enumerate(get_schedule(schedule).stage_rank(p)) if g == group}


def test_an_interleaved_rank_holds_fewer_than_its_stages_worst_counts_summed():
    """Interleaved 1F1B, 2 ranks, 4 microbatches: rank 0's stage 0 holds 4 at one moment and stage 2
    holds 2 at another, but the rank never holds more than 5 at once."""
    totals = [sum(k for _, k in counts) for _, counts in held_moments("interleaved-1f1b", 2, 4)[0]]
    assert max(totals) == 5
    assert held_per_stage("interleaved-1f1b", 2, 4)[0] + held_per_stage("interleaved-1f1b", 2, 4)[2] == 6


def test_a_group_counts_one_running_working_set():
    """Two stages per group, each keeping 100 B, 10 B per held microbatch and working with 1,000 B:
    the group's peak is both stages' kept bytes at the worst moment plus ONE working set."""
    est = memory_record(idle=100, per_microbatch=10, running=1000, optimizer=150)
    stages = [(s, s % 2, est, 2000.0) for s in range(4)]
    peaks = group_peaks(stages, "interleaved-1f1b", 2, 4)
    assert peaks[0] == 200 + 10 * 5 + 1000  # rank 0 holds 5 microbatches at most
    assert peaks[1] < 2 * 2000
    # without the records (a solution planned another way): the stages' peaks summed, the safe side
    assert group_peaks([(s, s % 2, {}, 2000.0) for s in range(4)], "interleaved-1f1b", 2, 4) == {0: 4000.0, 1: 4000.0}
    # the optimizer step of both stages at once, when it is the larger
    big = memory_record(idle=100, per_microbatch=10, running=10, optimizer=5000)
    assert group_peaks([(s, s % 2, big, 0.0) for s in range(4)], "interleaved-1f1b", 2, 4)[0] == 10000


def _problem(moments):
    """4 layer units on 2 groups, 2 stages each (interleaved 1F1B, m = 4), with the limit between what
    the group holds at its worst moment and what its stages hold each at its own worst count."""
    L = 4
    return StageProblem(fwd=[1.0] * L, bwd=[2.0] * L, grad_sync=[0.0] * L, state=[10.0] * L, act=[1.0] * L,
                        cut_seconds=[0.0] * (L - 1), cut_bytes=[0.0] * (L - 1),
                        stage_group=get_schedule("interleaved-1f1b").stage_rank(2),
                        held=list(held_per_stage("interleaved-1f1b", 2, 4)), m=4, memory_limit=41.5,
                        recompute=False, grads=[8.0] * L, opt_fixed=[0.0] * L, opt_peak=[0.0] * L,
                        moments=moments)


def test_the_stage_ilp_cuts_under_the_groups_peak_over_moments():
    """Each stage summed at its own worst count (4 and 2 microbatches) needs 20 + 6 + 16 = 42 B on group 0
    (states, activations, gradients), over the 41.5 B limit; at the schedule's worst moment the group
    holds 5 microbatches, 20 + 5 + 16 = 41 B (both stages' accumulated gradients are alive then: the
    runtime's record, ``stage_peak.stage_memory_record``, counts them whichever stage runs), and the
    ILP finds the cut (and ``group_memory`` prices it as the ILP did)."""
    starts, recompute = [0, 1, 2, 3], [False] * 4
    assert max(group_memory(_problem(None), starts, recompute).values()) == 42.0
    assert solve_stages(_problem(None), time_limit_s=2.0) is None
    prob = _problem(held_moments("interleaved-1f1b", 2, 4))
    assert group_memory(prob, starts, recompute)[0] == 41.0
    sol = solve_stages(prob, time_limit_s=2.0)
    assert sol is not None and sol.starts == starts
    assert max(group_memory(prob, sol.starts, sol.recompute).values()) <= prob.memory_limit
