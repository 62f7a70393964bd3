"""The problem the sharding ILP solves, as plain data, and the cheap moves made on it before solving.

A ``StrategyGraph`` holds nodes with one cost (seconds) and memory (bytes) per strategy, and edges
whose cost and memory depend on the producer's output placement class and the consumer's operand
placement class; ``multiplicity`` says how many identical layer instances a node or edge stands for.
``evaluate`` prices one full choice exactly.

*Policy groups* (``PolicyGroup``) tie decisions together: a group's member nodes list, per
strategy, the group policy that strategy belongs to, and every member must take a strategy of the
same policy (the planner expands the strategies of every op in a repeated-block type by that
type's memory-lever policy, ``passes.solve.lever_graph``). An edge pair that no valid choice can
meet (two members of one group under different policies) costs ``math.inf``: *forbidden*; the ILP
makes no variable for it.

Two moves need no solver: ``merge_followers`` folds
nodes whose strategy follows from their one operand into their producer (views, unary elementwise
ops), and ``greedy`` picks a quick assignment in node order (the ILP's fallback warm start). The
ILP itself (``passes/solve/ilp.py``) and the IOPDDL format conversion (``autoshard/contest/iopddl/problem.py``)
read this type. Knows nothing about torch.

>>> g = StrategyGraph([SGNode("a", [1.0, 0.5], [0, 0]), SGNode("b", [1.0, 0.5], [0, 0])],
...                   [SGEdge(0, 1, [0, 1], [0, 1], [[0.0, 3.0], [3.0, 0.0]])])
>>> greedy(g), g.evaluate([1, 1])
([1, 1], (1.0, 0))
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["SGNode", "SGEdge", "PolicyGroup", "StrategyGraph", "greedy", "merge_followers", "fix_policies"]


@dataclass
class SGNode:
    """One decision: per-strategy cost (s) and memory (bytes); ``allowed`` = pinned strategy indices."""
    name: str
    cost: list[float]
    memory: list[float]
    multiplicity: int = 1
    allowed: Optional[list[int]] = None

    def choices(self) -> list[int]:
        return list(range(len(self.cost))) if self.allowed is None else list(self.allowed)


@dataclass
class SGEdge:
    """Edge u -> v: ``u_class[s]`` / ``v_class[s]`` map strategies to placement classes; ``cost[p][q]``
    (s) and ``memory[p][q]`` (bytes) price producer class p meeting consumer class q. The two matrices
    are never changed once the edge is built: the graphs derived from it share them (``fix_policies``,
    ``merge_followers``), and ``ilp`` keeps each one's array."""
    u: int
    v: int
    u_class: list[int]
    v_class: list[int]
    cost: list[list[float]]
    memory: Optional[list[list[float]]] = None
    multiplicity: int = 1
    follow: Optional[list[int]] = None  # producer class p -> consumer class with the same placement, or -1


@dataclass
class PolicyGroup:
    """Nodes that must choose strategies of one common policy: ``members[node] = [policy of each
    strategy of that node]``, policies numbered ``0 .. num_policies - 1``."""
    name: str
    num_policies: int
    members: dict[int, list[int]] = field(default_factory=dict)

    def policy_of(self, choice: list[int]) -> Optional[int]:
        """The common policy of ``choice`` (0 for a group with no members left), or None when the
        members disagree."""
        found = {self.members[i][choice[i]] for i in self.members}
        return found.pop() if len(found) == 1 else (0 if not found else None)


@dataclass
class StrategyGraph:
    """Nodes, edges between them (by node index), the memory limit in bytes per device (None: none),
    and the policy groups tying node decisions together."""
    nodes: list[SGNode]
    edges: list[SGEdge]
    memory_limit: Optional[float] = None
    groups: list[PolicyGroup] = field(default_factory=list)

    def consistent(self, choice: list[int]) -> bool:
        """Every policy group's members agree on their policy."""
        return all(g.policy_of(choice) is not None for g in self.groups)

    def evaluate(self, choice: list[int]) -> tuple[float, float]:
        """Exact (cost, memory) of one strategy index per node (infinite when a group disagrees)."""
        if not self.consistent(choice):
            return math.inf, math.inf
        cost = sum(n.multiplicity * n.cost[c] for n, c in zip(self.nodes, choice))
        mem = sum(n.multiplicity * n.memory[c] for n, c in zip(self.nodes, choice))
        for e in self.edges:
            p, q = e.u_class[choice[e.u]], e.v_class[choice[e.v]]
            cost += e.multiplicity * e.cost[p][q]
            if e.memory is not None:
                mem += e.multiplicity * e.memory[p][q]
        return cost, mem


def greedy(graph: StrategyGraph, what: str = "cost", policies: Optional[list[int]] = None) -> list[int]:
    """A quick assignment in node order: each node takes the allowed strategy cheapest given the
    already-decided producers ("cost"), or the smallest node memory ("memory"). A policy group's
    members keep to ``policies[g]`` (default: the group's first policy for "cost", its last for
    "memory"; the planner orders policies from the fastest to the most frugal)."""
    incoming: dict[int, list[SGEdge]] = {}
    for e in graph.edges:
        if e.u != e.v:
            incoming.setdefault(e.v, []).append(e)
    within: dict[int, set[int]] = {}
    for g, group in enumerate(graph.groups):
        r = policies[g] if policies is not None else (0 if what == "cost" else group.num_policies - 1)
        for i, pol in group.members.items():
            within[i] = {s for s, p in enumerate(pol) if p == r}
    choice: list[int] = [n.choices()[0] for n in graph.nodes]
    decided = [False] * len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        def score(s):
            if what == "memory":
                return n.multiplicity * n.memory[s], n.multiplicity * n.cost[s]
            c = n.multiplicity * n.cost[s]
            for e in incoming.get(i, ()):
                if decided[e.u]:
                    c += e.multiplicity * e.cost[e.u_class[choice[e.u]]][e.v_class[s]]
            return c
        options = [s for s in n.choices() if i not in within or s in within[i]] or n.choices()
        choice[i] = min(options, key=score)
        decided[i] = True
    return choice


def merge_followers(graph: StrategyGraph) -> tuple[StrategyGraph, Callable[[list[int]], list[int]]]:
    """Fold every *follower* into its producer: a node ``v`` with exactly one in-edge ``u -> v`` (no
    pins, no self-edge, one edge instance per instance of ``v``) whose strategies are determined by
    the class of that operand, and whose in-edge says which consumer class equals each producer
    class (``follow``). ``v`` then takes the strategy that keeps its producer's placement, so views
    and unary elementwise ops never cost an ILP variable; when no strategy keeps producer class
    ``p``, ``v`` takes the one with the cheapest move from ``p``. Repeats until no follower is
    left (chains collapse). A follower in a policy group leaves it: its producer, in the same group
    (an edge between groups has no ``follow``), decides for both. Returns the smaller graph (node
    costs and memory as totals, multiplicity 1) and a function mapping its choice back to one index
    per original node.
    """
    cost = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
    mem = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
    edges = [SGEdge(e.u, e.v, list(e.u_class), list(e.v_class), e.cost, e.memory, e.multiplicity, e.follow)
             for e in graph.edges]
    absorbed: list[tuple[int, int, list[int]]] = []  # (v, u, f: u strategy -> v strategy), in order
    alive = [True] * len(graph.nodes)
    # One pass in node order folds what the old restart-after-every-fold loop folded, in the same order: a
    # fold of v into u only removes v's in-edge and moves v's out-edges to u, which can make no node
    # eligible that was not (the checks below read a node's in-edges, their producer and its liveness), so
    # after a fold the first eligible node is the next one after v. The in- and out-edge lists are kept up
    # to date instead of rescanning every edge per fold (quadratic: a 405B candidate's graphs fold
    # hundreds of nodes).
    ins: dict[int, list[SGEdge]] = {}
    outs: dict[int, list[SGEdge]] = {}
    for e in edges:
        ins.setdefault(e.v, []).append(e)
        outs.setdefault(e.u, []).append(e)
    removed: set[int] = set()
    for v, node in enumerate(graph.nodes):
        mine = ins.get(v, ())
        e = mine[0] if len(mine) == 1 else None
        if not alive[v] or e is None or e.u == v or e.follow is None or node.allowed is not None:
            continue
        if e.multiplicity != node.multiplicity or not alive[e.u]:
            continue
        by_class: dict[int, int] = {}
        if any(by_class.setdefault(q, s) != s for s, q in enumerate(e.v_class)):
            continue  # two strategies read the same placement: not determined by the operand
        u = e.u
        m = e.multiplicity
        f = []
        for s_u in range(len(cost[u])):
            p = e.u_class[s_u]
            q = e.follow[p]
            if q < 0 or q not in by_class:
                q = min(by_class, key=lambda q: (m * e.cost[p][q] + cost[v][by_class[q]], q))
                if math.isinf(e.cost[p][q]):  # no consumer strategy can meet p: u cannot take s_u
                    cost[u][s_u] = math.inf
            s_v = by_class[q]
            f.append(s_v)
            cost[u][s_u] += m * e.cost[p][q] + cost[v][s_v]
            mem[u][s_u] += m * (e.memory[p][q] if e.memory else 0.0) + mem[v][s_v]
        removed.add(id(e))
        ins[v] = []
        outs[u] = [e2 for e2 in outs[u] if e2 is not e]
        for e2 in outs.pop(v, ()):
            e2.u, e2.u_class = u, [e2.u_class[f[s]] for s in range(len(cost[u]))]
            outs[u].append(e2)
        absorbed.append((v, u, f))
        alive[v] = False
    edges = [e for e in edges if id(e) not in removed]
    keep = [i for i in range(len(graph.nodes)) if alive[i]]
    new_index = {old: k for k, old in enumerate(keep)}
    nodes = [SGNode(graph.nodes[i].name, cost[i], mem[i], 1, graph.nodes[i].allowed) for i in keep]
    for e in edges:
        e.u, e.v = new_index[e.u], new_index[e.v]
    groups = [PolicyGroup(g.name, g.num_policies, {new_index[i]: pol for i, pol in g.members.items() if alive[i]})
              for g in graph.groups]
    reduced = StrategyGraph(nodes, edges, graph.memory_limit, groups)

    def expand(choice: list[int]) -> list[int]:
        full = [-1] * len(graph.nodes)
        for k, old in enumerate(keep):
            full[old] = choice[k]
        for v, u, f in reversed(absorbed):
            full[v] = f[full[u]]
        return full

    return reduced, expand


def fix_policies(graph: StrategyGraph, policies: list[int]) -> tuple[StrategyGraph, Callable[[list[int]], list[int]]]:
    """The graph with every policy group fixed to ``policies[g]``: its members keep only the
    strategies of that policy (and the groups go). Returns the smaller graph and a function mapping
    its choice back to the original strategy indices. Costs are sliced, never recomputed."""
    kept: dict[int, list[int]] = {}
    for g, group in enumerate(graph.groups):
        for i, pol in group.members.items():
            kept[i] = [s for s, p in enumerate(pol) if p == policies[g]]
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i not in kept:
            nodes.append(n)
            continue
        old = kept[i]
        new_of = {s: j for j, s in enumerate(old)}
        allowed = None if n.allowed is None else [new_of[s] for s in n.allowed if s in new_of]
        nodes.append(SGNode(n.name, [n.cost[s] for s in old], [n.memory[s] for s in old], n.multiplicity, allowed))
    edges = []
    for e in graph.edges:
        u_class = e.u_class if e.u not in kept else [e.u_class[s] for s in kept[e.u]]
        v_class = e.v_class if e.v not in kept else [e.v_class[s] for s in kept[e.v]]
        edges.append(SGEdge(e.u, e.v, u_class, v_class, e.cost, e.memory, e.multiplicity, e.follow))
    fixed = StrategyGraph(nodes, edges, graph.memory_limit)

    def expand(choice: list[int]) -> list[int]:
        return [kept[i][c] if i in kept else c for i, c in enumerate(choice)]

    return fixed, expand
