"""``merge_followers`` folds in one pass what folding one node and rescanning from the first node folds.

The definition it must match (kept here as the reference): repeatedly, the first node in index order
that is a follower (one in-edge, not a self-edge, a ``follow`` table, no pins, the edge's multiplicity
the node's, a live producer, strategies told apart by their operand class) is folded into its producer,
and the scan starts again from node 0. The planner's fast version keeps in- and out-edge lists instead
of rescanning; on random graphs (chains, self-edges, pins, forbidden pairs, mixed multiplicities) both
give the same reduced graph and the same expansion of every choice.
"""
from __future__ import annotations

import math
import random

from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph, merge_followers


def _reference(graph: StrategyGraph):
    """Fold one follower, rescan from node 0 (the quadratic definition)."""
    cost = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
    mem = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
    edges = [SGEdge(e.u, e.v, list(e.u_class), list(e.v_class), e.cost, e.memory, e.multiplicity, e.follow)
             for e in graph.edges]
    absorbed, alive = [], [True] * len(graph.nodes)
    changed = True
    while changed:
        changed = False
        ins: dict = {}
        for e in edges:
            ins.setdefault(e.v, []).append(e)
        for v, node in enumerate(graph.nodes):
            e = ins[v][0] if len(ins.get(v, ())) == 1 else None
            if (not alive[v] or e is None or e.u == v or e.follow is None or node.allowed is not None
                    or e.multiplicity != node.multiplicity or not alive[e.u]):
                continue
            by_class: dict = {}
            if any(by_class.setdefault(q, s) != s for s, q in enumerate(e.v_class)):
                continue
            u, m, f = e.u, e.multiplicity, []
            for s_u in range(len(cost[u])):
                p = e.u_class[s_u]
                q = e.follow[p]
                if q < 0 or q not in by_class:
                    q = min(by_class, key=lambda q: (m * e.cost[p][q] + cost[v][by_class[q]], q))
                    if math.isinf(e.cost[p][q]):
                        cost[u][s_u] = math.inf
                s_v = by_class[q]
                f.append(s_v)
                cost[u][s_u] += m * e.cost[p][q] + cost[v][s_v]
                mem[u][s_u] += m * (e.memory[p][q] if e.memory else 0.0) + mem[v][s_v]
            edges = [x for x in edges if x is not e]
            for e2 in edges:
                if e2.u == v:
                    e2.u, e2.u_class = u, [e2.u_class[f[s]] for s in range(len(cost[u]))]
            absorbed.append((v, u, f))
            alive[v] = False
            changed = True
            break
    keep = [i for i in range(len(graph.nodes)) if alive[i]]
    new_index = {old: k for k, old in enumerate(keep)}
    nodes = [(graph.nodes[i].name, cost[i], mem[i], graph.nodes[i].allowed) for i in keep]
    edge_rows = [(new_index[e.u], new_index[e.v], e.u_class, e.v_class, e.cost, e.memory, e.multiplicity, e.follow)
                 for e in edges]

    def expand(choice):
        full = [-1] * len(graph.nodes)
        for k, old in enumerate(keep):
            full[old] = choice[k]
        for v, u, f in reversed(absorbed):
            full[v] = f[full[u]]
        return full

    return nodes, edge_rows, expand


def _graph(rng: random.Random) -> StrategyGraph:
    n = rng.randint(2, 30)
    nodes = []
    for i in range(n):
        k = rng.randint(1, 5)
        allowed = None if rng.random() < 0.85 else sorted(rng.sample(range(k), rng.randint(1, k)))
        nodes.append(SGNode(f"n{i}", [rng.random() for _ in range(k)], [rng.random() for _ in range(k)],
                            rng.choice([1, 1, 2]), allowed))
    edges = []
    for _ in range(rng.randint(1, 2 * n)):
        u = rng.randrange(n)
        v = rng.randrange(n) if rng.random() < 0.3 else min(n - 1, u + rng.randint(0, 3))  # chains, some back/self
        nu, nv = len(nodes[u].cost), len(nodes[v].cost)
        v_class = list(range(nv)) if rng.random() < 0.7 else [rng.randrange(rng.randint(1, nv)) for _ in range(nv)]
        P, Q = rng.randint(1, 3), max(v_class) + 1
        u_class = [rng.randrange(P) for _ in range(nu)]
        cost = [[rng.random() if rng.random() < 0.9 else math.inf for _ in range(Q)] for _ in range(P)]
        memory = [[rng.random() for _ in range(Q)] for _ in range(P)] if rng.random() < 0.7 else None
        follow = [rng.randrange(-1, Q) for _ in range(P)] if rng.random() < 0.8 else None
        edges.append(SGEdge(u, v, u_class, v_class, cost, memory, rng.choice([1, 1, 2]), follow))
    return StrategyGraph(nodes, edges, None, [])


def _copy(g: StrategyGraph) -> StrategyGraph:
    return StrategyGraph([SGNode(n.name, list(n.cost), list(n.memory), n.multiplicity, n.allowed) for n in g.nodes],
                         [SGEdge(e.u, e.v, list(e.u_class), list(e.v_class), e.cost, e.memory, e.multiplicity, e.follow)
                          for e in g.edges], g.memory_limit, [])


def test_one_pass_folds_as_the_rescanning_definition():
    folded = 0
    for seed in range(400):
        rng = random.Random(seed)
        g = _graph(rng)
        nodes, edge_rows, expand = _reference(_copy(g))
        reduced, fast_expand = merge_followers(_copy(g))
        # repr: the tables hold inf, which == handles but a mismatch message should show
        assert repr([(n.name, n.cost, n.memory, n.allowed) for n in reduced.nodes]) == repr(nodes), seed
        assert repr([(e.u, e.v, e.u_class, e.v_class, e.cost, e.memory, e.multiplicity, e.follow)
                     for e in reduced.edges]) == repr(edge_rows), seed
        for _ in range(4):
            choice = [rng.randrange(len(n[1])) for n in nodes]
            assert fast_expand(choice) == expand(choice), seed
        folded += len(g.nodes) - len(nodes)
    assert folded > 300  # the graphs do fold: the comparison is not between two untouched graphs


def test_a_chain_folds_into_its_head():
    # a -> b -> c, each following its operand: one node left, every choice expands along the chain
    move = [[0.0, 1.0], [1.0, 0.0]]
    g = StrategyGraph([SGNode(x, [1.0, 2.0], [0.0, 0.0]) for x in "abc"],
                      [SGEdge(0, 1, [0, 1], [0, 1], move, None, 1, [0, 1]),
                       SGEdge(1, 2, [0, 1], [0, 1], move, None, 1, [0, 1])])
    reduced, expand = merge_followers(g)
    assert [n.name for n in reduced.nodes] == ["a"] and reduced.edges == []
    assert reduced.nodes[0].cost == [3.0, 6.0]
    assert expand([1]) == [1, 1, 1]
