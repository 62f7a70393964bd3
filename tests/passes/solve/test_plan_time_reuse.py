"""Work a memory-bound plan no longer repeats (issue 31, item 10), each checked to change no answer:
the solver-free floors read in bulk equal their definition, and one lever search builds each
microstep count's problem, pricer and (for the same policies) lever graph once."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve import lever_search, planner
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.ilp import _floors
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.lever_search import LeverSearch
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph


def _floors_by_definition(graph: StrategyGraph) -> tuple[float, float]:
    """Every node at its cheapest allowed strategy of finite cost, every edge at its cheapest pair of
    finite cost among the classes those strategies reach (its memory: the smallest of those pairs')."""
    cost = memory = 0.0
    options = [[s for s in n.choices() if math.isfinite(n.cost[s])] for n in graph.nodes]
    for n, ss in zip(graph.nodes, options):
        if ss:
            cost += n.multiplicity * min(n.cost[s] for s in ss)
            memory += n.multiplicity * min(n.memory[s] for s in ss)
    for e in graph.edges:
        pairs = [(p, q) for p in {e.u_class[s] for s in options[e.u]} for q in {e.v_class[s] for s in options[e.v]}
                 if math.isfinite(e.cost[p][q])]
        if pairs:
            cost += e.multiplicity * min(e.cost[p][q] for p, q in pairs)
            if e.memory is not None:
                memory += e.multiplicity * min(e.memory[p][q] for p, q in pairs)
    return cost, memory


def _random_graph(rng: random.Random) -> StrategyGraph:
    nodes = []
    for i in range(6):
        n = rng.randrange(1, 6)
        cost = [rng.choice([math.inf, rng.uniform(0, 3)]) if rng.random() < 0.2 else rng.uniform(0, 3) for _ in range(n)]
        allowed = sorted(rng.sample(range(n), rng.randrange(1, n + 1))) if rng.random() < 0.5 else None
        nodes.append(SGNode(f"n{i}", cost, [rng.uniform(0, 9) for _ in range(n)], rng.randrange(1, 4), allowed))
    edges = []
    for _ in range(8):
        u, v = rng.randrange(6), rng.randrange(6)
        p, q = rng.randrange(1, 5), rng.randrange(1, 5)  # one class on a side too (the single-column read)
        cost = [[math.inf if rng.random() < 0.3 else rng.uniform(0, 2) for _ in range(q)] for _ in range(p)]
        memory = None if rng.random() < 0.3 else [[rng.uniform(0, 5) for _ in range(q)] for _ in range(p)]
        edges.append(SGEdge(u, v, [rng.randrange(p) for _ in nodes[u].cost], [rng.randrange(q) for _ in nodes[v].cost],
                            cost, memory, rng.randrange(1, 3)))
    return StrategyGraph(nodes, edges, None)


@pytest.mark.parametrize("seed", range(20))
def test_the_floors_read_in_bulk_are_every_node_and_edge_at_its_cheapest(seed):
    graph = _random_graph(random.Random(seed))
    assert _floors(graph) == _floors_by_definition(graph)  # exactly: the same minima, summed in the same order


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    return capture(_MLP(), (x,), loss_fn=F.mse_loss, target=torch.randn(8, 32))


def test_a_count_has_one_problem_and_pricer_and_the_same_policies_one_lever_graph(mlp):
    ctx = PlanContext.of(get_hardware("h100"), 1e6, "adamw", 30.0)
    search = LeverSearch(mlp, Mesh.of((2, 2)), ctx, None, LeverPins(), False)
    assert search.policies == {}  # no repeated block: the fastest policies are every policy
    problem, cm = search.problem(1)
    assert search.problem(1) == (problem, cm)
    assert search.pricer(problem, cm) is search.pricer(problem, cm)
    fastest = search.lever_graph(problem, cm, {}, None)
    every = search.graph(problem, cm, 123456.0)
    assert every.graph.nodes is fastest.graph.nodes and every.graph.edges is fastest.graph.edges
    assert (fastest.graph.memory_limit, every.graph.memory_limit) == (None, 123456.0)
    other, _ = search.problem(2)
    assert other is not problem and search.graph(other, cm, None).graph.nodes is not fastest.graph.nodes


def test_a_memory_bound_plan_without_blocks_prices_each_lever_graph_once(monkeypatch, mlp):
    """The plan without levers does not fit, so the search solves under the limit: the graph of the
    fastest policies it priced for that plan is the graph of every policy (there is no block type)."""
    built = []
    build = lever_search.build_lever_graph

    def counted(problem, pricer, policies, limit):
        built.append(id(problem))
        return build(problem, pricer, policies, limit)
    monkeypatch.setattr(lever_search, "build_lever_graph", counted)
    monkeypatch.setattr(planner, "build_lever_graph", counted, raising=False)  # where the planner built its own
    ctx = PlanContext.of(get_hardware("h100"), 1e6, "adamw", 30.0)
    free = planner.plan_sharding(mlp, Mesh.of((2, 2)), ctx, levers=LeverPins(accumulation=1))
    limited_ctx = PlanContext.of(get_hardware("h100"), 0.6 * free.estimated_memory, "adamw", 30.0)
    built.clear()
    sol = planner.plan_sharding(mlp, Mesh.of((2, 2)), limited_ctx, levers=LeverPins(accumulation=1))
    assert sol.estimated_memory <= 0.6 * free.estimated_memory < free.estimated_memory  # the limit binds
    assert len(built) == len(set(built)) == 1
