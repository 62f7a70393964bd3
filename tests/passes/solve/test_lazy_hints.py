"""Known plans' hints solved only when they can change the answer (``hint_plans.LazyHints``): a pipeline
candidate whose LP optimum is integral and that the LP's reduced costs prove cheaper than every layout's
best does not price the layouts (Llama 3 405B: 12 candidates, 3 layouts each), and answers as if they
had been solved first.
"""
from __future__ import annotations

import autoshard.passes.solve.ilp as ilp
from autoshard.layout_plans import published_layout_hints
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.hint_plans import LazyHints, pinned_choices
from autoshard.passes.solve.ilp import hint_objective, solve
from autoshard.passes.solve.problem import build_problem, strategy_choices
from autoshard.testing.graphs import gpt_graph


def _candidate(d: int = 256):
    captured = gpt_graph(2, batch=4, seq=32, d=d)
    mesh = Mesh((2, 2))
    hardware = get_hardware("h100")
    problem = build_problem(captured, mesh, hardware=hardware,
                            choices=strategy_choices(captured, mesh, None, storage_forms=True))
    graph = problem.strategy_graph(CostModel(problem.mesh, hardware), None)
    return problem, graph, published_layout_hints(captured, problem.mesh)


def _lazy(problem, graph, hints, calls: list, charged: list) -> LazyHints:
    def solve_hints():
        calls.append(1)
        return pinned_choices(problem, graph, hints, time_limit_s=2.0)
    return LazyHints(problem, graph, hints, solve_hints, charged.append, lambda: 5.0)


def test_lazy_hints_answer_as_solved_hints_and_skip_what_cannot_win(monkeypatch):
    problem, graph, hints = _candidate()
    eager, work = pinned_choices(problem, graph, hints, time_limit_s=2.0)
    assert len(eager) == 3
    expected = solve(graph, time_limit_s=5.0, hints=eager)
    bounds = []
    real_bound = ilp._hints_bound

    def recording(il, g, reduced, rounded, bound, kept):
        value = real_bound(il, g, reduced, rounded, bound, kept)
        index = {n.name: i for i, n in enumerate(g.nodes)}
        mine = [[h[index[n.name]] for n in reduced.nodes] for h in eager]
        bounds.append((value, [hint_objective(il, h) for h in mine], hint_objective(il, rounded)))
        return value

    monkeypatch.setattr(ilp, "_hints_bound", recording)
    calls, charged = [], []
    got = solve(graph, time_limit_s=5.0, hints=_lazy(problem, graph, hints, calls, charged))
    assert (got.choice, got.status, got.cost) == (expected.choice, expected.status, expected.cost)
    assert bounds, "premise: the LP optimum is integral and confirmed without CP-SAT"
    value, hinted, rounded = bounds[0]
    # the bound holds for every layout's best (a lower bound on its integer objective) ...
    assert all(value <= h + 1e-6 * abs(h) for h in hinted), (value, hinted)
    # ... and here it proves them all costlier than the LP optimum: none was solved, no work was charged
    assert value > rounded + len(graph.nodes) + len(graph.edges)
    assert calls == [] and charged == []


def test_lazy_hints_are_solved_and_charged_when_they_can_matter():
    problem, graph, hints = _candidate()
    eager, work = pinned_choices(problem, graph, hints, time_limit_s=2.0)
    graph.memory_limit = 1.02 * solve(graph, objective="memory", time_limit_s=5.0).memory  # binds: no LP shortcut
    expected = solve(graph, time_limit_s=5.0, hints=eager)
    calls, charged = [], []
    got = solve(graph, time_limit_s=5.0, hints=_lazy(problem, graph, hints, calls, charged))
    assert calls == [1] and charged == [work]
    assert (got.choice, got.status, got.cost) == (expected.choice, expected.status, expected.cost)
