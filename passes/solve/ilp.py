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
    """The model as plain rows over numbered variables, one constraint family per method; solved by
    CP-SAT (``solve_cpsat``), with GLOP's LP relaxation (``lp_relaxation``) as bound and warm start."""

    def __init__(self, graph: StrategyGraph):
        self.g = graph
        self.C = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
        self.M = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
        self.allowed = [n.choices() for n in graph.nodes]
        self.num_vars = 0
        self.x = [[self._new_var() for _ in n.cost] for n in graph.nodes]
        self.edge_terms: list[tuple[SGEdge, dict]] = []  # edges kept as variables: (edge, {(p, q): var})
        self.rows: list[tuple[str, list[int], list[int], float, float]] = []  # (kind, vars, coefs, lo, hi)
        self.objective: tuple[list[int], list[int]] = ([], [])
        self.scale = 1.0
        self._fold_edges()

    def _new_var(self) -> int:
        self.num_vars += 1
        return self.num_vars - 1

    def _classes(self, e: SGEdge) -> tuple[list[int], list[int]]:
        ps = sorted({e.u_class[s] for s in self.allowed[e.u]})
        qs = sorted({e.v_class[s] for s in self.allowed[e.v]})
        return ps, qs

    def _fold_edges(self) -> None:
        for e in self.g.edges:
            m = e.multiplicity
            ps, qs = self._classes(e)
            w = e.memory or [[0.0] * len(e.cost[0]) for _ in e.cost]
            if e.u == e.v:
                for s in range(len(self.C[e.u])):
                    p, q = e.u_class[s], e.v_class[s]
                    self.C[e.u][s] += m * e.cost[p][q]
                    self.M[e.u][s] += m * w[p][q]
            elif len(ps) == 1 or len(qs) == 1:
                node, fixed_p = (e.v, True) if len(ps) == 1 else (e.u, False)
                for s in range(len(self.C[node])):
                    p, q = (ps[0], e.v_class[s]) if fixed_p else (e.u_class[s], qs[0])
                    self.C[node][s] += m * e.cost[p][q]
                    self.M[node][s] += m * w[p][q]
            else:
                self.edge_terms.append((e, {(p, q): self._new_var() for p in ps for q in qs}))

    # ---- constraint families -------------------------------------------------------------------
    def add_one_strategy_per_node(self) -> None:
        """(1) sum_s x[i,s] = 1."""
        for xs in self.x:
            self.rows.append(("exactly_one", xs, [1] * len(xs), 1, 1))

    def add_edge_consistency(self) -> None:
        """(2) transportation form: row p of e sums to the producer's class-p indicator, column q to
        the consumer's class-q indicator."""
        for e, evars in self.edge_terms:
            ps, qs = self._classes(e)
            for p in ps:
                ys = [self.x[e.u][s] for s in self.allowed[e.u] if e.u_class[s] == p]
                es = [evars[p, q] for q in qs]
                self.rows.append(("linear", es + ys, [1] * len(es) + [-1] * len(ys), 0, 0))
            for q in qs:
                zs = [self.x[e.v][s] for s in self.allowed[e.v] if e.v_class[s] == q]
                es = [evars[p, q] for p in ps]
                self.rows.append(("linear", es + zs, [1] * len(es) + [-1] * len(zs), 0, 0))

    def _memory_terms(self, unit: float) -> tuple[list[int], list[int]]:
        ids, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.M[i][s] / unit)
                if c:
                    ids.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.memory[p][q] / unit) if e.memory else 0
                if c:
                    ids.append(var)
                    coefs.append(c)
        return ids, coefs

    def add_memory_constraint(self) -> None:
        """(3) total bytes per device <= L, in units of L / 1e9 (no-op without a limit)."""
        limit = self.g.memory_limit
        if limit is None:
            return
        unit = limit / _SCALE_TARGET if limit > 0 else 1.0
        ids, coefs = self._memory_terms(unit)
        self.rows.append(("linear", ids, coefs, -math.inf, math.floor(limit / unit)))

    def add_pins(self) -> None:
        """(4) x[i,s] = 0 for strategies a pin excludes."""
        for i, n in enumerate(self.g.nodes):
            if n.allowed is not None:
                keep = set(n.allowed)
                for s, var in enumerate(self.x[i]):
                    if s not in keep:
                        self.rows.append(("linear", [var], [1], 0, 0))

    def set_objective(self, what: str = "cost") -> None:
        """Minimize estimated step time ("cost") or bytes per device ("memory"), scaled to integers
        so the largest possible total is about 1e9."""
        table = self.M if what == "memory" else self.C
        edge_values = (lambda e: e.memory or [[0.0]]) if what == "memory" else (lambda e: e.cost)
        upper = sum(max(table[i][s] for s in self.allowed[i]) for i in range(len(self.x)))
        upper += sum(e.multiplicity * max(map(max, edge_values(e))) for e, _ in self.edge_terms)
        self.scale = _SCALE_TARGET / upper if upper > 0 else 1.0
        if what == "memory":
            self.objective = self._memory_terms(1.0 / self.scale)
            return
        ids, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.C[i][s] * self.scale)
                if c:
                    ids.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.cost[p][q] * self.scale)
                if c:
                    ids.append(var)
                    coefs.append(c)
        self.objective = (ids, coefs)

    # ---- solving -------------------------------------------------------------------------------
    def choice_from(self, value: Callable[[int], float]) -> list[int]:
        return [max(self.allowed[i], key=lambda s: value(xs[s])) for i, xs in enumerate(self.x)]

    def lp_relaxation(self) -> tuple[str, Optional[list[int]], Optional[float], bool]:
        """GLOP on the relaxation (0 <= x, e <= 1): (status, rounded choice, objective lower bound in
        objective units, whether the LP optimum is integral). Status "INFEASIBLE" proves the ILP
        infeasible too; "UNKNOWN" when GLOP is unavailable or fails."""
        from ortools.linear_solver import pywraplp
        lp = pywraplp.Solver.CreateSolver("GLOP")
        if lp is None:
            return "UNKNOWN", None, None, False
        v = [lp.NumVar(0.0, 1.0, "") for _ in range(self.num_vars)]
        for _, ids, coefs, lo, hi in self.rows:
            row = lp.RowConstraint(-lp.infinity() if lo == -math.inf else lo, hi, "")
            for k, c in zip(ids, coefs):
                row.SetCoefficient(v[k], c)
        obj = lp.Objective()
        for k, c in zip(*self.objective):
            obj.SetCoefficient(v[k], c)
        obj.SetMinimization()
        status = lp.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return "INFEASIBLE", None, None, False
        if status != pywraplp.Solver.OPTIMAL:
            return "UNKNOWN", None, None, False
        values = [var.solution_value() for var in v]
        integral = all(min(values[k], 1 - values[k]) < 1e-6 for xs in self.x for k in xs)
        return "OPTIMAL", self.choice_from(lambda k: values[k]), obj.Value(), integral

    def solve_cpsat(self, time_limit_s: float, workers: int, hint: Optional[list[int]] = None,
                    lower_bound: Optional[float] = None) -> ILPResult:
        model = cp_model.CpModel()
        v = [model.new_bool_var(f"v{k}") for k in range(self.num_vars)]
        for kind, ids, coefs, lo, hi in self.rows:
            if kind == "exactly_one":
                model.add_exactly_one([v[k] for k in ids])
            else:
                expr = cp_model.LinearExpr.weighted_sum([v[k] for k in ids], coefs)
                model.add_linear_constraint(expr, int(max(lo, -2 ** 62)), int(hi))
        objective = cp_model.LinearExpr.weighted_sum([v[k] for k in self.objective[0]], self.objective[1])
        model.minimize(objective)
        if lower_bound is not None:  # the LP bound, loosened against GLOP's float tolerance
            lo = math.floor(lower_bound - 1e-6 * abs(lower_bound) - 1)
            model.proto.objective.domain.extend([lo, sum(c for c in self.objective[1] if c > 0)])
        if hint is not None:
            on = {self.x[i][s] for i, s in enumerate(hint)}
            for e, evars in self.edge_terms:
                on.add(evars.get((e.u_class[hint[e.u]], e.v_class[hint[e.v]]), -1))
            for k, var in enumerate(v):
                model.add_hint(var, k in on)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = int(workers)
        solver.parameters.relative_gap_limit = 1e-5
        # Presolve (probing, symmetry) costs seconds on these models and buys nothing once the LP
        # bound and a complete hint are given; measured on a Llama block: 11 s -> 0.1 s.
        solver.parameters.cp_model_presolve = False
        t0 = time.perf_counter()
        status = solver.solve(model)
        wall = time.perf_counter() - t0
        name = solver.status_name(status)
        ncons = len(model.proto.constraints)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return ILPResult(None, math.inf, math.inf, name, wall, self.num_vars, ncons)
        choice = self.choice_from(lambda k: solver.boolean_value(v[k]))
        cost, mem = self.g.evaluate(choice)
        return ILPResult(choice, cost, mem, name, wall, self.num_vars, ncons,
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
    """Minimize ``objective`` ("cost" under the memory limit, or "memory") over ``graph``.

    Steps: fold followers (``merge_followers``, unless ``merge=False``); solve the LP relaxation
    with GLOP; give CP-SAT the LP bound and a warm start (the rounded LP optimum, else a greedy
    assignment). When the LP optimum is integral CP-SAT only confirms it. Status "INFEASIBLE"
    (choice None) when nothing fits the limit; "GREEDY" when CP-SAT found nothing in time but the
    greedy assignment fits.
    """
    reduced, expand = merge_followers(graph) if merge else (graph, list)
    ilp = ShardingILP(reduced)
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    if objective == "cost":
        ilp.add_memory_constraint()
    ilp.add_pins()
    ilp.set_objective(objective)
    limit = reduced.memory_limit if objective == "cost" else None

    def fits(choice):
        return limit is None or reduced.evaluate(choice)[1] <= limit

    t0 = time.perf_counter()
    lp_status, rounded, bound, integral = ilp.lp_relaxation()
    lp_s = time.perf_counter() - t0
    stats = dict(ilp_nodes=len(reduced.nodes), merged_followers=len(graph.nodes) - len(reduced.nodes),
                 lp_s=round(lp_s, 4), lp_integral=integral)
    if lp_status == "INFEASIBLE":  # the relaxation has no point under the limit: neither has the ILP
        return ILPResult(None, math.inf, math.inf, "INFEASIBLE", lp_s, ilp.num_vars, len(ilp.rows), stats)
    hint = greedy(reduced, objective)
    if not fits(hint):
        hint = greedy(reduced, "memory")
    if rounded is not None and fits(rounded):
        hint = rounded
    result = ilp.solve_cpsat(max(0.1, time_limit_s - lp_s), workers, hint, bound)
    result.wall_s += lp_s
    result.stats.update(stats)
    choice = result.choice
    if choice is None and result.status == "UNKNOWN" and fits(hint):
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
