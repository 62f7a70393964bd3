"""``ilp.solve`` skips CP-SAT where it would only confirm the LP's answer, and answers as CP-SAT does.

When the LP relaxation's optimum is integral, its memory row does not bind and that optimum is CP-SAT's
warm start within CP-SAT's relative gap of the bound it is handed, CP-SAT stops at its first solution
(the warm start) without work. ``solve`` then returns that answer itself (``stats["confirmed_by_lp"]``)
instead of building and loading CP-SAT's model. Checked here against CP-SAT run on the same graphs:
the same choice, status, cost and work charged (the planner's budgets count that work, so a different
figure would move later solves' limits), and the skip does happen.
"""
from __future__ import annotations

import random

import pytest

from autoshard.passes.solve import ilp
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph


def _chain_graph(rng: random.Random, n_nodes: int, limit: bool) -> StrategyGraph:
    """A chain with skip edges: tree-like graphs whose LP optimum is mostly integral."""
    k = 3
    nodes = [SGNode(f"n{i}", [rng.uniform(0, 5) for _ in range(k)], [rng.uniform(0, 10) for _ in range(k)],
                    rng.choice([1, 1, 3])) for i in range(n_nodes)]
    edges = []
    for v in range(1, n_nodes):
        for u in {v - 1, rng.randrange(v)} if rng.random() < 0.3 else {v - 1}:
            edges.append(SGEdge(u, v, [rng.randrange(2) for _ in range(k)], [rng.randrange(2) for _ in range(k)],
                                [[rng.uniform(0, 4) for _ in range(2)] for _ in range(2)],
                                [[rng.uniform(0, 3) for _ in range(2)] for _ in range(2)], rng.choice([1, 2])))
    least = sum(min(n.memory) * n.multiplicity for n in nodes)
    return StrategyGraph(nodes, edges, least * 3 if limit else None)


def test_confirmed_answers_are_cp_sats(monkeypatch):
    graphs = [_chain_graph(random.Random(seed), 12 + seed % 7, limit=seed % 2 == 0) for seed in range(40)]
    skipped = [ilp.solve(g, time_limit_s=5) for g in graphs]
    monkeypatch.setattr(ilp, "_confirmed", lambda *args: None)  # CP-SAT always runs
    solved = [ilp.solve(g, time_limit_s=5) for g in graphs]
    confirmed = 0
    for g, a, b in zip(graphs, skipped, solved):
        assert a.choice == b.choice and a.status == b.status
        assert a.cost == pytest.approx(b.cost) and a.memory == pytest.approx(b.memory)
        assert a.stats["work"] == b.stats["work"]
        assert a.stats["lower_bound"] == pytest.approx(b.stats["lower_bound"], rel=1e-9)
        confirmed += bool(a.stats.get("confirmed_by_lp"))
        assert not b.stats.get("confirmed_by_lp")
    assert confirmed >= 10, confirmed  # the path under test is taken


def test_fractional_or_binding_lps_still_run_cp_sat():
    # two nodes whose cheap strategies together overflow the limit: the memory row binds
    g = StrategyGraph([SGNode("a", [1.0, 2.0], [6.0, 1.0]), SGNode("b", [1.0, 2.0], [6.0, 1.0])],
                      [SGEdge(0, 1, [0, 1], [0, 1], [[0.0, 0.5], [0.5, 0.0]], None)], memory_limit=8.0)
    got = ilp.solve(g, time_limit_s=5)
    assert not got.stats.get("confirmed_by_lp")
    assert got.cost == pytest.approx(3.5)  # one node at its lean strategy (1 + 2), one move (0.5)


def test_an_lp_optimum_is_confirmed_whatever_the_objective_scale(monkeypatch):
    # one strategy per node priced 1e5 times the others: CP-SAT's integer objective is scaled so that the
    # costliest choice is ~1e9 units, leaving the optimum ~1e4 units, where one unit (the loosening of the
    # LP bound CP-SAT is handed) exceeds its relative gap. The integral LP optimum is still optimal: it is
    # returned without CP-SAT, as CP-SAT would return it, with no work charged (Llama 3 405B's least-memory
    # and unlimited solves searched 1-6 work-s each to return their warm start)
    rng = random.Random(7)
    graphs = []
    for seed in range(6):
        g = _chain_graph(random.Random(seed), 10, limit=False)
        for n in g.nodes:
            n.cost[rng.randrange(len(n.cost))] = 1e5
        graphs.append(g)
    skipped = [ilp.solve(g, time_limit_s=5) for g in graphs]
    monkeypatch.setattr(ilp, "_confirmed", lambda *args: None)
    solved = [ilp.solve(g, time_limit_s=5) for g in graphs]
    confirmed = 0
    for a, b in zip(skipped, solved):
        assert a.cost == pytest.approx(b.cost, rel=1e-9) and a.status == b.status == "OPTIMAL"
        if a.stats.get("confirmed_by_lp"):
            confirmed += 1
            assert a.stats["work"] == 0.0 and a.choice == b.choice
            assert b.stats["objective"] < 1e5  # the scale where one unit exceeds CP-SAT's relative gap
    assert confirmed >= 3, confirmed
