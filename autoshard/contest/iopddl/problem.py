"""The public IOPDDL strategy-graph format (ASPLOS/EuroSys 2025 contest, google/iopddl): reader,
writer, verifier, and conversion to and from the ``StrategyGraph`` of ``passes/solve/strategy_graph.py``.

A problem has nodes ``i`` with strategies ``s``: ``costs[i][s]``, ``usages[i][s]`` (memory held
during the half-open interval ``intervals[i] = [lo, hi)``); edges ``(u, v)`` with a row-major
``|S_u| x |S_v|`` cost matrix; and ``usage_limit``: at every time point the usages of the nodes
alive then must sum to at most the limit. An answer is one strategy index per node; its cost is
the sum of the chosen node costs and edge entries (Python ints: totals may exceed int64).

>>> p = Problem(costs=[[1, 5], [2, 0]], usages=[[3, 1], [2, 2]], intervals=[(0, 2), (1, 3)],
...             edges=[(0, 1)], edge_costs=[[0, 4, 4, 0]], usage_limit=4)
>>> verify(p, [0, 1])
Verdict(cost=5, peak=5, feasible=False)
>>> verify(p, [1, 1])
Verdict(cost=5, peak=3, feasible=True)
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from autoshard.passes.errors import AutoshardError
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph

__all__ = ["Problem", "Verdict", "IOPDDLFormatError", "read_problem", "parse_problem", "write_problem",
           "verify", "to_strategy_graph", "from_strategy_graph", "FORBIDDEN"]

FORBIDDEN = 10 ** 15
"""Costs at or above this mark forbidden choices (the contest files use 1e18)."""


class IOPDDLFormatError(AutoshardError):
    """An IOPDDL file is malformed (names the field and the fix)."""


@dataclass
class Problem:
    """One IOPDDL instance, fields as in the file (edges as ``(u, v)`` pairs, matrices row-major)."""
    costs: list[list[int]]
    usages: list[list[int]]
    intervals: list[tuple[int, int]]
    edges: list[tuple[int, int]]
    edge_costs: list[list[int]]
    usage_limit: Optional[int] = None
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    def edge_cost(self, e: int, su: int, sv: int) -> int:
        u, v = self.edges[e]
        return self.edge_costs[e][su * len(self.costs[v]) + sv]


class Verdict(NamedTuple):
    cost: int
    peak: int
    feasible: bool


def _fail(msg: str) -> None:
    raise IOPDDLFormatError(f"{msg}; the file must follow google/iopddl's problem JSON "
                            "(problem.nodes.{costs,usages,intervals}, problem.edges.{nodes,costs}, "
                            "problem.usage_limit)")


def parse_problem(doc: dict) -> Problem:
    """Validate and convert a loaded JSON document (``{"problem": {...}}`` or the inner object)."""
    if not isinstance(doc, dict):
        _fail("the top level is not a JSON object")
    p = doc.get("problem", doc)
    try:
        nodes, edges = p["nodes"], p.get("edges", {"nodes": [], "costs": []})
        costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
        enodes, ecosts = edges.get("nodes", []), edges.get("costs", [])
    except (KeyError, TypeError) as e:
        _fail(f"missing field {e}")
    n = len(costs)
    if len(usages) != n or len(intervals) != n:
        _fail(f"{n} nodes have costs but {len(usages)} usages and {len(intervals)} intervals")
    for i in range(n):
        if not costs[i] or len(costs[i]) != len(usages[i]):
            _fail(f"node {i}: {len(costs[i])} costs vs {len(usages[i])} usages (need the same, >= 1)")
        if len(intervals[i]) != 2:
            _fail(f"node {i}: interval {intervals[i]!r} is not [lo, hi)")
    if len(enodes) != len(ecosts):
        _fail(f"{len(enodes)} edges but {len(ecosts)} edge cost matrices")
    for e, (uv, m) in enumerate(zip(enodes, ecosts)):
        if len(uv) != 2 or not all(isinstance(k, int) and 0 <= k < n for k in uv):
            _fail(f"edge {e}: endpoints {uv!r} are not two node indices below {n}")
        if len(m) != len(costs[uv[0]]) * len(costs[uv[1]]):
            _fail(f"edge {e} ({uv[0]} -> {uv[1]}): matrix has {len(m)} entries, needs "
                  f"{len(costs[uv[0]])} x {len(costs[uv[1]])}")
    limit = p.get("usage_limit")
    extra = {k: v for k, v in p.items() if k not in ("nodes", "edges", "usage_limit", "name")}
    return Problem(costs, usages, [tuple(iv) for iv in intervals], [tuple(uv) for uv in enodes], ecosts,
                   None if limit is None else int(limit), str(p.get("name", "")), extra)


def read_problem(path: str) -> Problem:
    """Read ``PROBLEM.json`` or ``PROBLEM.json.gz`` (JSON only, never pickle)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise IOPDDLFormatError(f"{path}: not readable JSON ({e}); pass a .json or .json.gz file") from None
    return parse_problem(doc)


def write_problem(problem: Problem, path: str) -> None:
    """Write in the contest format (gzipped when ``path`` ends in .gz)."""
    p = {"name": problem.name,
         "nodes": {"costs": problem.costs, "usages": problem.usages,
                   "intervals": [list(iv) for iv in problem.intervals]},
         "edges": {"nodes": [list(uv) for uv in problem.edges], "costs": problem.edge_costs}}
    if problem.usage_limit is not None:
        p["usage_limit"] = problem.usage_limit
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump({"problem": p}, f)


def peak_usage(problem: Problem, choice: list[int]) -> int:
    """Largest sum of chosen usages alive at one time point (a sweep over interval ends)."""
    delta: dict[int, int] = {}
    for i, s in enumerate(choice):
        lo, hi = problem.intervals[i]
        u = problem.usages[i][s]
        if lo < hi and u:
            delta[lo] = delta.get(lo, 0) + u
            delta[hi] = delta.get(hi, 0) - u
    peak = load = 0
    for t in sorted(delta):
        load += delta[t]
        peak = max(peak, load)
    return peak


def verify(problem: Problem, choice: list[int]) -> Verdict:
    """Exact cost, peak usage and feasibility (limit kept, no forbidden cost) of an answer."""
    if len(choice) != problem.num_nodes:
        raise IOPDDLFormatError(f"answer has {len(choice)} entries for {problem.num_nodes} nodes; "
                                "give one strategy index per node")
    for i, s in enumerate(choice):
        if not 0 <= s < len(problem.costs[i]):
            raise IOPDDLFormatError(f"node {i}: strategy {s} out of range 0..{len(problem.costs[i]) - 1}")
    cost = sum(int(problem.costs[i][s]) for i, s in enumerate(choice))
    forbidden = any(problem.costs[i][s] >= FORBIDDEN for i, s in enumerate(choice))
    for e, (u, v) in enumerate(problem.edges):
        c = int(problem.edge_costs[e][choice[u] * len(problem.costs[v]) + choice[v]])
        forbidden |= c >= FORBIDDEN
        cost += c
    peak = peak_usage(problem, choice)
    ok = not forbidden and (problem.usage_limit is None or peak <= problem.usage_limit)
    return Verdict(cost, peak, ok)


def to_strategy_graph(problem: Problem) -> StrategyGraph:
    """A ``StrategyGraph`` with the same costs (one class per strategy). Its memory constraint is a
    single total, so every node's usage counts as always alive: exact when all intervals share a time
    point, otherwise conservative (whatever fits the graph fits the problem)."""
    nodes = [SGNode(f"n{i}", [float(c) for c in problem.costs[i]],
                    [float(u) if problem.intervals[i][0] < problem.intervals[i][1] else 0.0
                     for u in problem.usages[i]]) for i in range(problem.num_nodes)]
    edges = []
    for e, (u, v) in enumerate(problem.edges):
        su, sv = len(problem.costs[u]), len(problem.costs[v])
        m = problem.edge_costs[e]
        edges.append(SGEdge(u, v, list(range(su)), list(range(sv)),
                            [[float(m[a * sv + b]) for b in range(sv)] for a in range(su)]))
    limit = None if problem.usage_limit is None else float(problem.usage_limit)
    return StrategyGraph(nodes, edges, limit)


def from_strategy_graph(graph: StrategyGraph, *, cost_unit: float = 1e-9, memory_unit: float = 1.0) -> Problem:
    """The problem a ``StrategyGraph`` poses, in integer units (``cost_unit`` seconds, ``memory_unit``
    bytes): multiplicities multiplied in, class-indexed edge tables expanded to full matrices, every
    node alive at time 0 (the graph's memory is one total). Edge memory has no place in the format
    and must be zero."""
    if graph.groups:
        raise IOPDDLFormatError("the graph ties decisions in policy groups (memory levers), which the IOPDDL "
                                "format cannot express; plan without levers to export it")
    costs, usages = [], []
    for n in graph.nodes:
        costs.append([round(n.multiplicity * c / cost_unit) for c in n.cost])
        usages.append([round(n.multiplicity * m / memory_unit) for m in n.memory])
    edges, ecosts = [], []
    for e in graph.edges:
        if e.memory is not None and any(any(r) for r in e.memory):
            raise IOPDDLFormatError(f"edge {e.u} -> {e.v} carries memory, which the IOPDDL format cannot "
                                    "express; fold it into node memory first")
        if e.u == e.v:
            raise IOPDDLFormatError(f"self-edge on node {e.u}; fold it into the node's costs first")
        edges.append((e.u, e.v))
        ecosts.append([round(e.multiplicity * e.cost[e.u_class[a]][e.v_class[b]] / cost_unit)
                       for a in range(len(graph.nodes[e.u].cost)) for b in range(len(graph.nodes[e.v].cost))])
    limit = None if graph.memory_limit is None else int(graph.memory_limit // memory_unit)
    return Problem(costs, usages, [(0, 1)] * len(costs), edges, ecosts, limit)
