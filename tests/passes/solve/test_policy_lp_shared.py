"""The policy combinations of one lever graph solve their ILPs on one GLOP solver (issue 31, item 10): each
combination's ILP takes over the last one's solver (``ShardingILP.adopt_lp``), its objective and changed rows
set in place, so its first LP restarts from that basis instead of cold. Checked on the planner's search of a
tiny GPT under a binding memory limit: only the first combination's first LP starts cold, each first LP's
bound is the one a fresh solver finds, and the plan's estimates are those of the search without it."""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.solve import policy_solves
from autoshard.passes.solve.lp_relaxation import LPRelaxation


def _first_solves(monkeypatch, plan_within, captured, limit):
    """The plan under ``limit`` and, per policy combination solved under it, its first solve's (whether
    its ILP's solver was another's, its LP bound in seconds)."""
    return _recorded_plan(monkeypatch, lambda: plan_within(captured, limit))


def test_each_policy_combination_after_the_first_restarts_from_the_last_ones_lp(monkeypatch, tiny_gpt, plan_within):
    captured, limit = tiny_gpt
    with monkeypatch.context() as m:
        plan, shared = _first_solves(m, plan_within, captured, limit)
    with monkeypatch.context() as m:
        m.setattr(LPRelaxation, "adopt_lp", lambda self, donor: False)
        alone, cold = _first_solves(m, plan_within, captured, limit)
    assert len(shared) == len(cold) >= 3  # the policy combinations of one microstep count, each solved
    assert [adopted for adopted, _ in shared] == [False] + [True] * (len(shared) - 1)  # one cold first LP
    assert not any(adopted for adopted, _ in cold)
    for (_, bound), (_, fresh) in zip(shared, cold):
        assert bound == pytest.approx(fresh, rel=1e-6)  # the same LP, solved from another start
    assert plan.estimated_step_time == pytest.approx(alone.estimated_step_time, rel=1e-9)
    assert plan.estimated_memory == alone.estimated_memory


def test_the_published_layouts_of_a_memory_bound_plan_share_one_lp_solver(monkeypatch):
    """Through ``autoshard.plan``: under a binding ``memory_limit`` the published layouts' ILPs on one lever
    graph (slices of one shape for a mesh's two axes) restart from the last one's LP, and the plan's
    estimates are those of the plan that starts every layout's LP cold."""
    import torch.nn.functional as F

    import autoshard
    from autoshard.testing.models import DeepMLP

    torch.manual_seed(0)
    model, x = DeepMLP(), torch.randn(8, 16, 64)

    def plan(memory_limit=None):
        return autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=x.clone(),
                              hardware="h100", memory_limit=memory_limit)

    limit = int(0.55 * plan().estimated_memory)
    with monkeypatch.context() as m:
        shared, firsts = _recorded_plan(m, lambda: plan(limit))
    with monkeypatch.context() as m:
        m.setattr(LPRelaxation, "adopt_lp", lambda self, donor: False)
        alone, cold = _recorded_plan(m, lambda: plan(limit))
    assert sum(adopted for adopted, _ in firsts) >= 2 and not any(adopted for adopted, _ in cold)
    assert len(firsts) == len(cold)
    for (_, bound), (_, fresh) in zip(firsts, cold):
        assert bound == pytest.approx(fresh, rel=1e-6)
    assert shared.estimated_step_time == pytest.approx(alone.estimated_step_time, rel=1e-9)
    assert shared.estimated_memory == alone.estimated_memory


def _recorded_plan(monkeypatch, planned):
    """``planned()`` and its first solves under a memory limit, as ``_first_solves`` records them."""
    firsts = []
    solve = policy_solves.solve

    def recorded(graph, **kwargs):
        kept = kwargs.get("kept")
        first = kept is not None and kept.get("graph") is not graph
        result = solve(graph, **kwargs)
        if first and graph.memory_limit is not None and "lp_s" in result.stats:
            firsts.append((result.stats.get("lp_adopted", False), result.stats["lower_bound"]))
        return result
    monkeypatch.setattr(policy_solves, "solve", recorded)
    return planned(), firsts
