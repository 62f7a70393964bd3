"""The strategy-selection ILP, solved with OR-tools CP-SAT. Knows nothing about torch.

Input: a ``StrategyGraph``: nodes ``i`` with strategies ``s``, each with a cost ``C[i,s]`` (seconds)
and a memory ``M[i,s]`` (bytes); edges ``(u, v)`` whose cost depends on the producer's output
placement class ``p = cls_u(s_u)`` and the consumer's operand placement class ``q = cls_v(s_v)``:
``c_e[p,q]`` seconds and ``w_e[p,q]`` bytes; multiplicities ``m_i``, ``m_e`` (how many identical
layer instances a cluster node / edge stands for); a memory limit ``L`` (bytes per device).

    variables   x[i,s] in {0,1}          node i runs strategy s
                e[p,q] in {0,1}          per edge: producer class p meets consumer class q
    (1) one strategy per node            sum_s x[i,s] = 1
    (2) edge consistency                 sum_q e[p,q] = sum_{s: cls_u(s)=p} x[u,s]      for every p
        (transportation form)            sum_p e[p,q] = sum_{s: cls_v(s)=q} x[v,s]      for every q
    (3) memory                           sum_i m_i sum_s M[i,s] x[i,s] + sum_e m_e sum_pq w_e[p,q] e[p,q] <= L
    (4) pins                             x[i,s] = 0 for every s not allowed at node i
    objective   minimize  sum_i m_i sum_s C[i,s] x[i,s] + sum_e m_e sum_pq c_e[p,q] e[p,q]

With exactly one x per node, (2) makes e the indicator of the single (p, q) pair in use, so the
linearization is exact while using |P| x |Q| edge variables instead of |S_u| x |S_v|. An edge whose
producer (or consumer) side can only be in one class costs a function of the other side alone, and
an edge from a node to itself (a cluster feeding its own next instance) a function of that node's
strategy; both are folded into C and M without edge variables. CP-SAT needs integer coefficients:
costs are scaled so the largest possible total is about 1e9 units, bytes by ``L / 1e9``.

>>> g = StrategyGraph([SGNode("a", [1.0, 0.5], [0, 0]), SGNode("b", [1.0, 0.5], [0, 0])],
...                   [SGEdge(0, 1, [0, 1], [0, 1], [[0.0, 3.0], [3.0, 0.0]])])
>>> solve(g).choice
[1, 1]
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ortools.sat.python import cp_model

__all__ = ["SGNode", "SGEdge", "StrategyGraph", "ILPResult", "ShardingILP", "solve", "greedy", "merge_followers"]

_SCALE_TARGET = 1e9


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
    (s) and ``memory[p][q]`` (bytes) price producer class p meeting consumer class q."""
    u: int
    v: int
    u_class: list[int]
    v_class: list[int]
    cost: list[list[float]]
    memory: Optional[list[list[float]]] = None
    multiplicity: int = 1
    follow: Optional[list[int]] = None  # producer class p -> consumer class with the same placement, or -1


@dataclass
class StrategyGraph:
    nodes: list[SGNode]
    edges: list[SGEdge]
    memory_limit: Optional[float] = None

    def evaluate(self, choice: list[int]) -> tuple[float, float]:
        """Exact (cost, memory) of one strategy index per node."""
        cost = sum(n.multiplicity * n.cost[c] for n, c in zip(self.nodes, choice))
        mem = sum(n.multiplicity * n.memory[c] for n, c in zip(self.nodes, choice))
        for e in self.edges:
            p, q = e.u_class[choice[e.u]], e.v_class[choice[e.v]]
            cost += e.multiplicity * e.cost[p][q]
            if e.memory is not None:
                mem += e.multiplicity * e.memory[p][q]
        return cost, mem


@dataclass
class ILPResult:
    choice: Optional[list[int]]
    cost: float
    memory: float
    status: str
    wall_s: float
    num_variables: int
    num_constraints: int
    stats: dict = field(default_factory=dict)


class ShardingILP:
    """Builds the model one constraint family per method, then solves it."""

    def __init__(self, graph: StrategyGraph):
        self.g = graph
        self.model = cp_model.CpModel()
        self.C = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
        self.M = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
        self.allowed = [n.choices() for n in graph.nodes]
        self.x = [[self.model.new_bool_var(f"x{i}_{s}") for s in range(len(n.cost))]
                  for i, n in enumerate(graph.nodes)]
        self.edge_terms: list[tuple[SGEdge, dict]] = []  # edges kept as variables: (edge, {(p, q): var})
        self._fold_edges()

    def _classes(self, e: SGEdge) -> tuple[list[int], list[int]]:
        ps = sorted({e.u_class[s] for s in self.allowed[e.u]})
        qs = sorted({e.v_class[s] for s in self.allowed[e.v]})
        return ps, qs

    def _fold_edges(self) -> None:
        for e in self.g.edges:
            m = e.multiplicity
            ps, qs = self._classes(e)
            if e.u == e.v:
                for s in range(len(self.C[e.u])):
                    p, q = e.u_class[s], e.v_class[s]
                    self.C[e.u][s] += m * e.cost[p][q]
                    self.M[e.u][s] += m * (e.memory[p][q] if e.memory else 0.0)
            elif len(ps) == 1:
                for s in range(len(self.C[e.v])):
                    q = e.v_class[s]
                    self.C[e.v][s] += m * e.cost[ps[0]][q]
                    self.M[e.v][s] += m * (e.memory[ps[0]][q] if e.memory else 0.0)
            elif len(qs) == 1:
                for s in range(len(self.C[e.u])):
                    p = e.u_class[s]
                    self.C[e.u][s] += m * e.cost[p][qs[0]]
                    self.M[e.u][s] += m * (e.memory[p][qs[0]] if e.memory else 0.0)
            else:
                evars = {(p, q): self.model.new_bool_var(f"e{e.u}_{e.v}_{p}_{q}") for p in ps for q in qs}
                self.edge_terms.append((e, evars))

    # ---- constraint families -------------------------------------------------------------------
    def add_one_strategy_per_node(self) -> None:
        """(1) sum_s x[i,s] = 1."""
        for xs in self.x:
            self.model.add_exactly_one(xs)

    def add_edge_consistency(self) -> None:
        """(2) transportation form: rows of e sum to the producer's class indicator, columns to the
        consumer's."""
        for e, evars in self.edge_terms:
            ps, qs = self._classes(e)
            for p in ps:
                self.model.add(sum(evars[p, q] for q in qs)
                               == sum(self.x[e.u][s] for s in self.allowed[e.u] if e.u_class[s] == p))
            for q in qs:
                self.model.add(sum(evars[p, q] for p in ps)
                               == sum(self.x[e.v][s] for s in self.allowed[e.v] if e.v_class[s] == q))

    def memory_expr(self, unit: float):
        terms, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.M[i][s] / unit)
                if c:
                    terms.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            if e.memory is None:
                continue
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.memory[p][q] / unit)
                if c:
                    terms.append(var)
                    coefs.append(c)
        return cp_model.LinearExpr.weighted_sum(terms, coefs)

    def add_memory_constraint(self) -> None:
        """(3) total bytes per device <= L (no-op without a limit)."""
        limit = self.g.memory_limit
        if limit is None:
            return
        unit = max(1.0, limit / _SCALE_TARGET)
        self.model.add(self.memory_expr(unit) <= math.floor(limit / unit))

    def add_pins(self) -> None:
        """(4) x[i,s] = 0 for strategies a pin excludes."""
        for i, n in enumerate(self.g.nodes):
            if n.allowed is not None:
                keep = set(n.allowed)
                for s, var in enumerate(self.x[i]):
                    if s not in keep:
                        self.model.add(var == 0)

    # ---- objective and solve -------------------------------------------------------------------
    def set_objective(self, what: str = "cost") -> None:
        """Minimize estimated step time ("cost") or bytes per device ("memory")."""
        if what == "memory":
            upper = sum(max(self.M[i][s] for s in self.allowed[i]) for i in range(len(self.x)))
            upper += sum(e.multiplicity * max(map(max, e.memory)) for e, _ in self.edge_terms if e.memory)
            self.model.minimize(self.memory_expr(max(1.0, upper / _SCALE_TARGET)))
            return
        upper = sum(max(self.C[i][s] for s in self.allowed[i]) for i in range(len(self.x)))
        upper += sum(e.multiplicity * max(map(max, e.cost)) for e, _ in self.edge_terms)
        scale = _SCALE_TARGET / upper if upper > 0 else 1.0
        terms, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.C[i][s] * scale)
                if c:
                    terms.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.cost[p][q] * scale)
                if c:
                    terms.append(var)
                    coefs.append(c)
        self.model.minimize(cp_model.LinearExpr.weighted_sum(terms, coefs))

    def add_hint(self, choice: list[int]) -> None:
        for i, xs in enumerate(self.x):
            for s, var in enumerate(xs):
                self.model.add_hint(var, s == choice[i])
        for e, evars in self.edge_terms:
            pq = (e.u_class[choice[e.u]], e.v_class[choice[e.v]])
            for key, var in evars.items():
                self.model.add_hint(var, key == pq)

    def solve(self, time_limit_s: float = 30.0, workers: int = 2) -> ILPResult:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = int(workers)
        t0 = time.perf_counter()
        status = solver.solve(self.model)
        wall = time.perf_counter() - t0
        proto = self.model.proto
        nvars, ncons = len(proto.variables), len(proto.constraints)
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return ILPResult(None, math.inf, math.inf, name, wall, nvars, ncons)
        choice = [next(s for s, var in enumerate(xs) if solver.boolean_value(var)) for xs in self.x]
        cost, mem = self.g.evaluate(choice)
        return ILPResult(choice, cost, mem, name, wall, nvars, ncons,
                         {"objective": solver.objective_value, "bound": solver.best_objective_bound})


def greedy(graph: StrategyGraph, what: str = "cost") -> list[int]:
    """A quick assignment in node order: each node takes the allowed strategy cheapest given the
    already-decided producers ("cost"), or the smallest node memory ("memory")."""
    incoming: dict[int, list[SGEdge]] = {}
    for e in graph.edges:
        if e.u != e.v:
            incoming.setdefault(e.v, []).append(e)
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
        choice[i] = min(n.choices(), key=score)
        decided[i] = True
    return choice


def solve(graph: StrategyGraph, *, objective: str = "cost", time_limit_s: float = 30.0, workers: int = 2,
          merge: bool = True) -> ILPResult:
    """Build and solve the ILP (after ``merge_followers`` unless ``merge=False``). Status
    "INFEASIBLE" (choice None) when no assignment fits the limit; "GREEDY" when CP-SAT found
    nothing in time but the greedy assignment fits. ``stats`` counts merged followers."""
    reduced, expand = merge_followers(graph) if merge else (graph, list)
    ilp = ShardingILP(reduced)
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    if objective == "cost":
        ilp.add_memory_constraint()
    ilp.add_pins()
    ilp.set_objective(objective)
    hint = greedy(reduced, objective)
    if objective == "cost" and reduced.memory_limit is not None and reduced.evaluate(hint)[1] > reduced.memory_limit:
        hint = greedy(reduced, "memory")
    ilp.add_hint(hint)
    result = ilp.solve(time_limit_s, workers)
    result.stats["ilp_nodes"] = len(reduced.nodes)
    result.stats["merged_followers"] = len(graph.nodes) - len(reduced.nodes)
    choice = result.choice
    if choice is None and result.status == "UNKNOWN":
        cost, mem = reduced.evaluate(hint)
        if objective != "cost" or reduced.memory_limit is None or mem <= reduced.memory_limit:
            choice, result.status = hint, "GREEDY"
    if choice is not None:
        result.choice = expand(choice)
        result.cost, result.memory = graph.evaluate(result.choice)
    return result


def merge_followers(graph: StrategyGraph) -> tuple[StrategyGraph, Callable[[list[int]], list[int]]]:
    """Fold every *follower* into its producer: a node ``v`` with exactly one in-edge ``u -> v`` (no
    pins, no self-edge, one edge instance per instance of ``v``) whose strategies are determined by
    the class of that operand, and whose in-edge says which consumer class equals each producer
    class (``follow``). ``v`` then takes the strategy that keeps its producer's placement, so views
    and unary elementwise ops never cost an ILP variable; when no strategy keeps producer class
    ``p``, ``v`` takes the one with the cheapest move from ``p``. Repeats until no follower is
    left (chains collapse). Returns the smaller graph (node costs and memory as totals,
    multiplicity 1) and a function mapping its choice back to one index per original node.
    """
    cost = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
    mem = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
    edges = [SGEdge(e.u, e.v, list(e.u_class), list(e.v_class), e.cost, e.memory, e.multiplicity, e.follow)
             for e in graph.edges]
    absorbed: list[tuple[int, int, list[int]]] = []  # (v, u, f: u strategy -> v strategy), in order
    alive = [True] * len(graph.nodes)
    changed = True
    while changed:
        changed = False
        ins: dict[int, list[SGEdge]] = {}
        for e in edges:
            ins.setdefault(e.v, []).append(e)
        for v, node in enumerate(graph.nodes):
            e = ins.get(v, [None])[0] if len(ins.get(v, ())) == 1 else None
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
                s_v = by_class[q]
                f.append(s_v)
                cost[u][s_u] += m * e.cost[p][q] + cost[v][s_v]
                mem[u][s_u] += m * (e.memory[p][q] if e.memory else 0.0) + mem[v][s_v]
            edges.remove(e)
            for e2 in edges:
                if e2.u == v:
                    e2.u, e2.u_class = u, [e2.u_class[f[s]] for s in range(len(cost[u]))]
            absorbed.append((v, u, f))
            alive[v] = False
            changed = True
            break
    keep = [i for i in range(len(graph.nodes)) if alive[i]]
    new_index = {old: k for k, old in enumerate(keep)}
    nodes = [SGNode(graph.nodes[i].name, cost[i], mem[i], 1, graph.nodes[i].allowed) for i in keep]
    for e in edges:
        e.u, e.v = new_index[e.u], new_index[e.v]
    reduced = StrategyGraph(nodes, edges, graph.memory_limit)

    def expand(choice: list[int]) -> list[int]:
        full = [-1] * len(graph.nodes)
        for k, old in enumerate(keep):
            full[old] = choice[k]
        for v, u, f in reversed(absorbed):
            full[v] = f[full[u]]
        return full

    return reduced, expand
