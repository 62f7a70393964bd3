"""Cheaper solves under a binding memory limit (issue 31, item 10) that must not change an answer:
the CP-SAT model written straight into its proto (``passes/solve/cpsat_model.py``) is the model
``cp_model``'s calls build, and a graph solved again under a lower memory limit with ``ilp.solve(kept=...)``
(the planner's peak retries: the ILP and its LP solver kept, the LP restarted from its last basis) reaches
the optimum a fresh solve reaches, checked against brute force."""
from __future__ import annotations

import itertools
import random

import pytest
from ortools.sat.python import cp_model

from autoshard.passes.solve.cpsat_model import cpsat_model
from autoshard.passes.solve.ilp import ShardingILP, solve
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph


def _reference(num_vars, rows, objective, fixed_zero):
    """The model as ``cp_model``'s own calls build it (what ``ShardingILP.solve_cpsat`` did before)."""
    model = cp_model.CpModel()
    v = [model.new_constant(0) if k in fixed_zero else model.new_bool_var(f"v{k}") for k in range(num_vars)]
    for kind, ids, coefs, lo, hi in rows:
        if kind == "exactly_one":
            model.add_exactly_one([v[k] for k in ids])
        else:
            model.add_linear_constraint(cp_model.LinearExpr.weighted_sum([v[k] for k in ids], coefs),
                                        int(max(lo, -2 ** 62)), int(hi))
    model.minimize(cp_model.LinearExpr.weighted_sum([v[k] for k in objective[0]], objective[1]))
    return model


@pytest.mark.parametrize("seed", range(6))
def test_the_bulk_proto_is_the_model_cp_models_calls_build(seed):
    rng = random.Random(seed)
    n = 40
    fixed = frozenset(rng.sample(range(n), rng.randrange(0, 12)))
    rows = []
    for _ in range(25):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 9))]  # repeats, fixed variables, any order
        if rng.random() < 0.3:
            rows.append(("exactly_one", ids, [1] * len(ids), 1, 1))
        else:
            coefs = [rng.choice([-3, -1, 0, 1, 2, 5]) for _ in ids]
            rows.append(("linear", ids, coefs, rng.choice([0, -float("inf")]), rng.randrange(0, 9)))
    objective = ([rng.randrange(n) for _ in range(30)], [rng.randrange(0, 50) for _ in range(30)])
    model, index_of = cpsat_model(n, rows, objective, fixed)
    assert str(model.proto) == str(_reference(n, rows, objective, fixed).proto)
    assert len({index_of[k] for k in fixed}) <= 1  # the fixed variables share one constant


def _graph(seed: int) -> StrategyGraph:
    """Seven nodes where speed costs memory, chained by edges whose placements cost time and bytes."""
    rng = random.Random(seed)
    nodes = [SGNode(f"n{i}", sorted(rng.uniform(1, 5) for _ in range(3)),
                    sorted((rng.uniform(1, 10) for _ in range(3)), reverse=True)) for i in range(7)]
    edges = [SGEdge(v - 1, v, [rng.randrange(3) for _ in range(3)], [rng.randrange(3) for _ in range(3)],
                    [[rng.uniform(0, 2) for _ in range(3)] for _ in range(3)],
                    [[rng.uniform(0, 2) for _ in range(3)] for _ in range(3)]) for v in range(1, 7)]
    return StrategyGraph(nodes, edges, None)


def _optimum(g: StrategyGraph, limit: float):
    costs = [g.evaluate(list(c)) for c in itertools.product(*(range(len(n.cost)) for n in g.nodes))]
    fits = [c for c, m in costs if m <= limit]
    return min(fits) if fits else None


def _solve_again(seed: int) -> int:
    """Solve one graph under four ever lower limits with one ``kept``, each answer checked against brute
    force and each kept LP against a fresh one; returns how many of those LPs the memory row bound."""
    g = _graph(seed)
    small = sum(min(n.memory) for n in g.nodes) + sum(min(map(min, e.memory)) for e in g.edges)
    fast = g.evaluate([0] * len(g.nodes))[1]
    kept: dict = {}
    ilps, binding = set(), 0
    for share in (0.8, 0.6, 0.45, 0.3):  # each limit lower, as the planner's retries lower it
        g.memory_limit = small + share * (fast - small)
        got = solve(g, time_limit_s=10, merge=False, kept=kept)
        want = _optimum(g, g.memory_limit)
        if want is None:
            assert got.choice is None
            continue
        assert got.status == "OPTIMAL" and got.cost == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert got.memory <= g.memory_limit
        ilp = kept["model"][2]
        ilps.add(id(ilp))
        assert ilp.lp_relaxation()[2] / ilp.scale == pytest.approx(_fresh_lp_bound(g), rel=1e-5)
        binding += bool(ilp.memory_binding)
    assert len(ilps) == 1  # one ILP, its bound lowered: not rebuilt
    return binding


def test_a_graph_solved_again_under_lower_limits_keeps_its_ilp_and_each_optimum():
    assert sum(_solve_again(seed) for seed in range(4)) > 0  # some kept LPs re-solved under a binding row


def _fresh_lp_bound(g: StrategyGraph) -> float:
    """The LP relaxation's optimum (seconds) of ``g`` built afresh at its current limit."""
    ilp = ShardingILP(g)
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    ilp.add_memory_constraint()
    ilp.add_pins()
    ilp.set_objective("cost")
    return ilp.lp_relaxation()[2] / ilp.scale


def _pinned_chain(seed: int, n: int = 40, size: int = 6, classes: int = 3) -> StrategyGraph:
    """A chain of ``n`` nodes of ``size`` strategies, four of them allowed (pins, which GLOP's presolve
    removes), where speed costs memory."""
    rng = random.Random(seed)
    nodes = [SGNode(f"n{i}", sorted(rng.uniform(1, 5) for _ in range(size)),
                    sorted((rng.uniform(1, 10) for _ in range(size)), reverse=True),
                    allowed=sorted(rng.sample(range(size), 4))) for i in range(n)]
    edges = [SGEdge(v - 1, v, [rng.randrange(classes) for _ in range(size)],
                    [rng.randrange(classes) for _ in range(size)],
                    [[rng.uniform(0, 2) for _ in range(classes)] for _ in range(classes)],
                    [[rng.uniform(0, 2) for _ in range(classes)] for _ in range(classes)]) for v in range(1, n)]
    return StrategyGraph(nodes, edges, None)


@pytest.mark.parametrize("seed", range(3))
def test_the_first_lp_of_a_memory_bound_ilp_leaves_a_basis_the_next_lp_restarts_from(seed):
    """The LP solved after the first on a kept ILP (a peak retry's lowered bound, the Lagrangian price)
    restarts from the first one's basis: a handful of simplex iterations, not the first one's hundred. The
    first was presolved, its basis then the reduced problem's, and the second started cold (a tiny Llama:
    0.17-0.25 CPU s each, 4 policies and 2 layouts a memory-limited plan)."""
    g = _pinned_chain(seed)
    small = sum(min(n.memory) for n in g.nodes) + sum(min(map(min, e.memory)) for e in g.edges)
    fast = g.evaluate([n.choices()[0] for n in g.nodes])[1]
    g.memory_limit = small + 0.6 * (fast - small)
    ilp = ShardingILP(g)
    ilp.solved_again = True  # kept for peak retries, as ``ilp.solve(kept=...)`` marks it
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    ilp.add_memory_constraint()
    ilp.add_pins()
    ilp.set_objective("cost")
    assert ilp.lp_relaxation()[0] == "OPTIMAL" and ilp.memory_binding
    ilp.set_memory_limit(small + 0.5 * (fast - small))
    status, _, bound, _ = ilp.lp_relaxation()
    assert status == "OPTIMAL" and bound / ilp.scale == pytest.approx(_fresh_lp_bound(g), rel=1e-6)
    first, again = ilp.lp_iterations
    assert first >= 50 and again * 2 <= first
