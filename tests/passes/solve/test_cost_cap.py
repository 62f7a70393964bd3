"""The ILP's cost cap (``ilp.solve(cap=...)``, ``ShardingILP.add_cost_cap``): the published layouts'
finalists want no plan whose exposed floor exceeds the best overlapped step (issue 31, item 10)."""
import itertools
import math
import random

from autoshard.passes.solve.ilp import solve
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph


def _graph(rng: random.Random, memory_limit=None) -> StrategyGraph:
    """Four nodes of three strategies; a chain of edges of two classes a side (kept as variables), an edge
    whose producer has one class (folded into its consumer), a self-edge (folded into its node), and one
    forbidden class pair."""
    nodes = [SGNode(f"n{i}", [rng.uniform(1, 10) for _ in range(3)], [rng.uniform(1, 10) for _ in range(3)])
             for i in range(4)]
    def prices(p, q):
        return [[rng.uniform(0, 5) for _ in range(q)] for _ in range(p)]
    edges = [SGEdge(0, 1, [0, 1, 1], [1, 0, 1], prices(2, 2), prices(2, 2)),
             SGEdge(1, 2, [0, 0, 1], [0, 1, 1], prices(2, 2), prices(2, 2)),
             SGEdge(2, 3, [1, 0, 1], [0, 1, 0], prices(2, 2), prices(2, 2)),
             SGEdge(0, 3, [0, 0, 0], [0, 1, 2], prices(1, 3), prices(1, 3)),
             SGEdge(2, 2, [0, 1, 2], [2, 1, 0], prices(3, 3), prices(3, 3))]
    edges[1].cost[1][0] = math.inf
    return StrategyGraph(nodes, edges, memory_limit)


def _counted(graph: StrategyGraph, choice, nodes, edges) -> float:
    total = sum(graph.nodes[i].cost[choice[i]] for i in nodes)
    for j in edges:
        e = graph.edges[j]
        total += e.cost[e.u_class[choice[e.u]]][e.v_class[choice[e.v]]]
    return total


def test_capped_solve_is_the_cheapest_choice_within_the_cap():
    rng = random.Random(3)
    for trial in range(12):
        graph = _graph(rng, memory_limit=rng.uniform(20, 40))
        nodes, edges = {0, 2}, {1, 3, 4}
        every = [list(c) for c in itertools.product(range(3), repeat=4)]
        counted = sorted(_counted(graph, c, nodes, edges) for c in every
                         if math.isfinite(graph.evaluate(c)[0]))
        seconds = counted[len(counted) // 3]  # exactly one choice's counted cost: a choice at the cap stays
        within = [(graph.evaluate(c)[0], c) for c in every if math.isfinite(graph.evaluate(c)[0])
                  and graph.evaluate(c)[1] <= graph.memory_limit and _counted(graph, c, nodes, edges) <= seconds]
        result = solve(graph, cap=(nodes, edges, seconds), capped_now=True)
        if not within:
            assert result.choice is None, trial
            continue
        assert result.choice is not None and result.stats.get("capped"), trial
        assert _counted(graph, result.choice, nodes, edges) <= seconds * (1 + 1e-9), trial
        assert math.isclose(result.cost, min(within)[0], rel_tol=1e-6), trial


def test_a_cap_that_binds_changes_the_answer_and_one_that_does_not_keeps_it():
    rng = random.Random(5)
    graph = _graph(rng)
    nodes, edges = {1, 3}, {0, 2}
    free = solve(graph)
    at = _counted(graph, free.choice, nodes, edges)
    assert solve(graph, cap=(nodes, edges, at), capped_now=True).cost == free.cost
    tight = solve(graph, cap=(nodes, edges, at * 0.8), capped_now=True)
    assert tight.choice is None or _counted(graph, tight.choice, nodes, edges) <= at * 0.8
    assert tight.choice is None or tight.cost >= free.cost
