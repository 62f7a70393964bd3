"""The stage planner's candidate phase spends what it is given, and its exact savings change nothing.

- ``plan_candidates(total_s=...)``: the finalists' re-solves share what the first pass leaves of
  ``total_s`` (deterministic work); with nothing left a finalist keeps its first-pass plan.
- ``build_strategy_graph(edges_from=...)`` (the held-1 graph reusing the held-k graph's edges) gives
  the graph built from scratch.
- ``plan_sharding(explain=False)`` still refuses what does not fit, with a short message, and
  ``plan_pipeline``'s own refusal still carries the core plan's explanation.
"""
from __future__ import annotations

import re

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages import search
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.solve.microbatch import MicrobatchCostModel, MicrobatchFacts
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.problem import build_problem
from autoshard.passes.solve.strategy_graph import StrategyGraph
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch

HW = PRESETS["h100"]


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(1024, 128, 4, 2, 64, False)
    ids = torch.empty(16, 64, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


def _unproven(monkeypatch):
    """The first pass's answers reported as not proven optimal (these small ILPs always are), so the
    re-solve rule is exercised; returns the list of (pp, shape, time limit) of every solve."""
    real = search.profile_candidates
    calls = []

    def wrapped(captured, mesh, pps, ctx, spec, *, stats, **kwargs):
        out = real(captured, mesh, pps, ctx, spec, stats=stats, **kwargs)
        for key in out:
            calls.append((key, ctx.time_limit_s))
            stats[key]["status"] = "FEASIBLE"
        return out

    monkeypatch.setattr(search, "profile_candidates", wrapped)
    return calls


def _leaner(stats) -> int:
    """How many leaner tries (``stage_fit``: the best finalist under a tighter budget) ran after the
    re-solves."""
    return sum("leaner" in row for row in stats["candidates"].values())


def _candidates(gpt, **kwargs):
    stats = {}
    profiles = search.plan_candidates(gpt, Mesh((4,)), [2, 4], PlanContext.of(HW, optimizer="adamw"),
                                      PipelineSearch(quick_s=0.5, thorough_s=3.0, finalists=2, **kwargs), stats=stats)
    return profiles, stats


def test_finalists_are_re_solved_from_what_the_first_pass_leaves(gpt, monkeypatch):
    calls = _unproven(monkeypatch)
    _, free = _candidates(gpt)  # no total: every finalist re-solved with thorough_s
    first = len(free["candidates"])
    assert [c[1] for c in calls[:first]] == [0.5] * first and len(free["finalists"]) == 2
    # then the re-solves, then the best finalist's leaner try (``stage_fit``), at the first pass's cap
    assert [c[1] for c in calls[first:len(calls) - _leaner(free)]] == [3.0, 3.0] and free["not_resolved"] == []

    calls.clear()
    _, tight = _candidates(gpt, total_s=0.0)  # the first pass already spent more than the total
    assert all(c[1] == 0.5 for c in calls)  # no re-solve
    assert tight["not_resolved"] == tight["finalists"]
    assert all("quick" not in row for row in tight["candidates"].values())

    calls.clear()
    spent = sum(row["work_s"] for row in tight["candidates"].values())
    _, some = _candidates(gpt, total_s=spent + 2.0)  # room for one re-solve of at most 2 work-s
    limits = [c[1] for c in calls[len(some["candidates"]):len(calls) - _leaner(some)]]
    assert limits and limits[0] == pytest.approx(2.0)
    assert all(limit > 0.5 for limit in limits)  # a re-solve never gets less than the first pass had


def test_graph_reusing_edges_equals_the_graph_built_from_scratch(gpt):
    mesh = Mesh((2, 2))
    problem = build_problem(gpt, mesh, hardware=HW, facts=MicrobatchFacts(gpt, HW, 4))
    held3 = problem.strategy_graph(MicrobatchCostModel(mesh, HW, "adamw", 4, 3), 1e9)
    fresh = problem.strategy_graph(MicrobatchCostModel(mesh, HW, "adamw", 4, 1), 2e9)
    reused = problem.strategy_graph(MicrobatchCostModel(mesh, HW, "adamw", 4, 1), 2e9, edges_from=held3)
    assert reused.memory_limit == fresh.memory_limit == 2e9
    assert reused.nodes == fresh.nodes
    assert reused.edges == fresh.edges
    assert [n.memory for n in held3.nodes] != [n.memory for n in fresh.nodes]  # held does change the nodes
    with pytest.raises(ValueError, match="not the same problem"):
        problem.strategy_graph(MicrobatchCostModel(mesh, HW, "adamw", 4, 1), None,
                               edges_from=StrategyGraph(held3.nodes[:-1], held3.edges))


def test_core_plan_refusal_without_explanation_and_the_pipeline_error_with_it(gpt):
    with pytest.raises(InfeasiblePlanError, match="explain=True") as short:
        plan_sharding(gpt, (2, 2), PlanContext.of(HW, memory_limit=1e5), explain=False)
    assert not re.search(r"smallest plan needs \d", str(short.value))
    with pytest.raises(InfeasiblePlanError, match=r"smallest plan needs \d"):
        plan_sharding(gpt, (2, 2), PlanContext.of(HW, memory_limit=1e5))
    with pytest.raises(InfeasiblePlanError, match=r"The plan without a pipeline failed too: .*smallest plan needs \d"):
        plan_pipeline(gpt, (2, 2), PlanContext.of("h100", memory_limit=1e5, time_limit_s=60.0))


def test_a_candidate_planned_again_reuses_its_problem_graphs_and_hint_solves_with_the_same_plans(gpt, monkeypatch):
    # re-solves and the leaner try plan a candidate again: its problem is built once (per candidate), its
    # graphs once per held count and budget, its hints solved once per graph; every plan is what a fresh
    # build gives, and every solve is charged the same work
    from autoshard.layout_plans import published_layout_hints
    from autoshard.passes.pipeline.stages import candidate_plan
    _unproven(monkeypatch)
    built = []
    real_build = candidate_plan.build_problem
    monkeypatch.setattr(candidate_plan, "build_problem", lambda *a, **k: built.append(1) or real_build(*a, **k))
    profiles, stats = _candidates(gpt, hints_for=published_layout_hints)
    reused = len(built)
    real_plan = candidate_plan.plan_submesh
    monkeypatch.setattr(search, "plan_submesh", lambda *a, memo=None, **k: real_plan(*a, **k))
    built.clear()
    fresh, fresh_stats = _candidates(gpt, hints_for=published_layout_hints)
    assert reused == len(stats["candidates"]) < len(built)

    def solves(row):
        return {k: (v if not isinstance(v, dict) else solves(v)) for k, v in row.items() if k not in ("wall_s",)}
    assert {k: solves(r) for k, r in stats["candidates"].items()} == {k: solves(r) for k, r in fresh_stats["candidates"].items()}
    assert profiles.keys() == fresh.keys()
    for key, prof in profiles.items():
        assert prof.costs == fresh[key].costs, key
        assert prof.solution.solver_stats["objective"] == fresh[key].solution.solver_stats["objective"], key


def test_core_plan_refused_by_its_memory_floor_runs_no_solver(gpt, monkeypatch):
    # every plan's bytes exceed the limit (the graph's memory floor does): plan_pipeline's core plan
    # (explain=False) refuses without solving the plan without levers or the least-memory plan, whose
    # answers could not fit (Llama 3 405B without a pipeline: 6.8 CPU s for that refusal)
    from autoshard.passes.solve.ilp_model import ShardingILP
    searched = []
    real_lp = ShardingILP.lp_relaxation
    monkeypatch.setattr(ShardingILP, "lp_relaxation", lambda self: searched.append(1) or real_lp(self))
    with pytest.raises(InfeasiblePlanError, match="explain=True"):
        plan_sharding(gpt, (2, 2), PlanContext.of(HW, memory_limit=1e5), explain=False)
    assert searched == []
    with pytest.raises(InfeasiblePlanError, match=r"smallest plan needs \d"):  # explained: the smallest is solved
        plan_sharding(gpt, (2, 2), PlanContext.of(HW, memory_limit=1e5))
    assert searched
