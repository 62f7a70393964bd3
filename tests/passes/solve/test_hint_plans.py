"""Known plans as solver hints (issue 28 item 4): ``ilp.solve(graph, hints=...)`` starts from the best hint
and never returns anything costlier, and a pipeline candidate's intra-op plan
(``candidate_plan.plan_submesh(hints=...)``) is never priced above the published layout of its shape that it
was shown, even when the solver stops short (simulated by a CP-SAT that finds nothing in its limit: the
case Llama 3 405B's 4-virtual-stage layout hit, whose configuration's quick solve ranked it out).
"""
from __future__ import annotations

import math
import random

import pytest

import autoshard.passes.solve.ilp as ilp
from autoshard.layout_plans import published_layout_hints
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.candidate_plan import CandidateSpec, plan_submesh
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.ilp import ILPResult, solve
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph
from autoshard.testing.graphs import gpt_graph


def _graph(seed: int) -> StrategyGraph:
    rng = random.Random(seed)
    nodes = [SGNode(f"n{i}", [rng.uniform(0, 5) for _ in range(3)], [rng.uniform(0, 10) for _ in range(3)])
             for i in range(8)]
    edges = [SGEdge(v - 1, v, [0, 1, 2], [0, 1, 2], [[rng.uniform(0, 4) for _ in range(3)] for _ in range(3)])
             for v in range(1, 8)]
    return StrategyGraph(nodes, edges, None)


@pytest.fixture
def cp_sat_stops_short(monkeypatch):
    """A CP-SAT that finds nothing within its limit, recording the warm start it was given."""
    given = []
    _stop_cp_sat(monkeypatch, given)
    return given


@pytest.fixture
def solver_stops_short(monkeypatch):
    """No LP answer and a CP-SAT that finds nothing: only the greedy assignment and the hints are left."""
    _stop_cp_sat(monkeypatch, [])
    monkeypatch.setattr(ilp.ShardingILP, "lp_relaxation", lambda self: ("UNKNOWN", None, None, False))


def _stop_cp_sat(monkeypatch, given: list) -> None:

    def nothing(self, work_limit, workers, hint=None, lower_bound=None, **kwargs):
        given.append(hint)
        return ILPResult(None, float("inf"), float("inf"), "UNKNOWN", 0.0, self.num_vars, len(self.rows), {"work": 0.0})
    monkeypatch.setattr(ilp.ShardingILP, "solve_cpsat", nothing)
    # CP-SAT is always called: an integral LP optimum is not returned without it (``ilp._confirmed``)
    monkeypatch.setattr(ilp, "_confirmed", lambda *args: None)


def test_the_best_hint_is_the_warm_start_and_the_floor(cp_sat_stops_short):
    g = _graph(0)
    choices = [[s] * 8 for s in range(3)]
    costs = [g.evaluate(c)[0] for c in choices]
    got = solve(g, merge=False, hints=choices)  # the rounded LP optimum may beat every hint: it stands then
    assert got.choice is not None and got.cost <= min(costs) + 1e-9
    assert cp_sat_stops_short[-1] is not None
    assert g.evaluate(cp_sat_stops_short[-1])[0] <= min(costs) + 1e-9  # CP-SAT started from it or better


def test_a_hint_that_breaks_the_memory_limit_is_ignored(cp_sat_stops_short):
    g = _graph(1)
    g.memory_limit = 1e-9  # nothing fits
    assert solve(g, merge=False, hints=[[0] * 8]).choice is None


def test_a_real_solve_is_never_worse_than_its_hints():
    for seed in range(4):
        g = _graph(seed)
        hints = [[random.Random(seed + k).randrange(3) for _ in range(8)] for k in range(3)]
        got = solve(g, merge=False, hints=hints)
        assert got.cost <= min(g.evaluate(h)[0] for h in hints) + 1e-9


def test_a_pipeline_candidate_is_never_priced_above_the_layout_it_contains(solver_stops_short):
    captured = gpt_graph(2, batch=4, seq=32, d=1024)  # wide and a small batch: Megatron's kind of model
    submesh = Mesh((2, 2))
    common = dict(ctx=PlanContext.of(get_hardware("h100"), 2 * 80e9, "adamw", 2.0),
                  spec=CandidateSpec(microbatches=2, held=2))
    hints = published_layout_hints(captured, submesh)
    assert len(hints) == 3  # Megatron's (without and with its distributed optimizer) and FSDP's on (dp, tp) = (2, 2)
    assert any(str(v[0]).endswith("/zero1") for v in hints[1].params.values())
    # under the candidate's own objective (one microbatch's ILP cost, the optimizer step priced by the stage
    # scorer): ``estimated_step_time`` re-prices the plan as one whole step without a pipeline
    layouts = [plan_submesh(captured, submesh, pins=h, **common).solver_stats["objective"] for h in hints]
    seeded = plan_submesh(captured, submesh, hints=hints, **common).solver_stats["objective"]
    assert seeded <= min(layouts) * (1 + 1e-9)
    # Since main's Megatron pricing (issue 27) the greedy plan's step time beats both layouts' on this model,
    # so this no longer shows the hints winning by themselves (on the ILP that is
    # test_a_hint_better_than_a_short_real_solve_is_returned).


def _hard_graph(seed: int, n: int = 80, k: int = 5) -> StrategyGraph:
    """Random costs on a two-parent DAG with a memory limit that binds: CP-SAT needs seconds, not 0.1."""
    rng = random.Random(seed)
    nodes = [SGNode(f"n{i}", [rng.uniform(0, 5) for _ in range(k)], [rng.uniform(0, 10) for _ in range(k)])
             for i in range(n)]
    edges = [SGEdge(u, v, list(range(k)), list(range(k)), [[rng.uniform(0, 4) for _ in range(k)] for _ in range(k)])
             for v in range(1, n) for u in rng.sample(range(v), k=min(v, 2))]
    return StrategyGraph(nodes, edges, 1.6 * sum(min(x.memory) for x in nodes))


def test_a_hint_better_than_a_short_real_solve_is_returned():
    """No stand-in solver: a 0.1 work-second CP-SAT stops well above the optimum of this problem; shown the
    optimum (from a long solve) as a hint, the same short solve returns it or better."""
    g = _hard_graph(1)
    best = solve(g, merge=False, time_limit_s=10)
    assert best.status == "OPTIMAL"
    short = solve(g, merge=False, time_limit_s=0.1)
    assert short.cost > best.cost * 1.05  # premise: without the hint the short solve loses (by ~50% here)
    hinted = solve(g, merge=False, time_limit_s=0.1, hints=[[0] * len(g.nodes), best.choice])
    assert hinted.choice is not None and hinted.cost <= best.cost * (1 + 1e-9)
    cost, memory = g.evaluate(hinted.choice)
    assert cost == pytest.approx(hinted.cost) and memory <= g.memory_limit  # a real, consistent choice


def _submesh_problem(captured, submesh):
    from autoshard.passes.solve.problem import build_problem
    from autoshard.passes.cost.model import CostModel
    hardware = get_hardware("h100")
    from autoshard.passes.solve.problem import strategy_choices
    # with the parameters' storage forms, as a pipeline candidate's problem has them (the ZeRO-1 hint's pins)
    problem = build_problem(captured, submesh, hardware=hardware,
                            choices=strategy_choices(captured, submesh, None, storage_forms=True))
    return problem, problem.strategy_graph(CostModel(problem.mesh, hardware), None)


def test_pinned_choices_keep_to_their_pins_and_skip_pins_that_do_not_hold():
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.solve.hint_plans import pinned_choices
    captured = gpt_graph(2, batch=4, seq=32, d=256)
    problem, graph = _submesh_problem(captured, Mesh((2, 2)))
    hints = published_layout_hints(captured, problem.mesh)
    impossible = Pins(params={next(iter(captured.params)): ("S(0)", "S(0)")}, ops={"*": ("R", "R")})
    choices, work = pinned_choices(problem, graph, [*hints, impossible], time_limit_s=2.0)
    assert len(choices) == len(hints) and work >= 0  # the contradictory pins give no choice, not an error
    for pins, choice in zip(hints, choices):
        allowed = Pins(params=pins.params, inputs=pins.inputs, ops=pins.ops).resolve(captured, problem.table,
                                                                                     problem.mesh)
        for i, names in enumerate(problem.clustering.members):
            for name in names:
                if name in allowed:
                    assert choice[i] in allowed[name], (name, choice[i], allowed[name])
        assert math.isfinite(graph.evaluate(choice)[0])
    assert len({tuple(c) for c in choices}) == 3  # Megatron's, with ZeRO-1, and FSDP's are different plans


def test_pinned_choices_solve_a_smaller_ilp_with_the_pinned_graphs_optimum(monkeypatch):
    """A layout's solve runs on the graph cut down to what its pins allow (a node left one strategy folds
    into its neighbours' prices), not on the whole graph with pins: fewer ILP variables, and the
    same optimum as the pinned graph's."""
    import autoshard.passes.solve.hint_plans as hint_plans
    from dataclasses import replace
    from autoshard.passes.sharding.pins import Pins
    captured = gpt_graph(2, batch=4, seq=32, d=256)
    problem, graph = _submesh_problem(captured, Mesh((2, 2)))
    hints = published_layout_hints(captured, problem.mesh)
    solved = []

    def recording(g, **kw):
        result = solve(g, **kw)
        solved.append(result)
        return result

    monkeypatch.setattr(hint_plans, "solve", recording)
    choices, _ = hint_plans.pinned_choices(problem, graph, hints, time_limit_s=5.0)
    assert len(choices) == len(hints) == len(solved)
    for pins, choice, sliced in zip(hints, choices, solved):
        allowed = Pins(params=pins.params, inputs=pins.inputs, ops=pins.ops).resolve(captured, problem.table,
                                                                                     problem.mesh)
        nodes = [n if not any(name in allowed for name in names) else
                 replace(n, allowed=sorted(set(n.choices()).intersection(
                     *(allowed[name] for name in names if name in allowed))))
                 for n, names in zip(graph.nodes, problem.clustering.members)] + [graph.nodes[-1]]
        pinned = solve(StrategyGraph(nodes, graph.edges, graph.memory_limit, graph.groups), time_limit_s=5.0)
        assert pinned.status == sliced.status == "OPTIMAL"
        assert graph.evaluate(choice)[0] == pytest.approx(pinned.cost, rel=1e-9)
        # (GPT's small graph here: 1192 variables instead of 1474; pinned, it was the same ILP as ``pinned``)
        assert sliced.num_variables < 0.9 * pinned.num_variables, (sliced.num_variables, pinned.num_variables)
