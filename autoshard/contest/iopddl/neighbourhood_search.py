"""Exact re-solve of a neighbourhood of a presolved IOPDDL ``Core`` with CP-SAT, everything outside
it fixed at the current state (large-neighbourhood search, Shaw 1998). With the whole core as the
region this is the exact model of the problem.

    x[i,a] in {0,1}     node i of the region takes strategy a            sum_a x[i,a] = 1
    y[e,a,b] in {0,1}   edge e = (i, j) inside the region takes (a, b)   sum_b y[e,a,b] = x[i,a]
                                                                         sum_a y[e,a,b] = x[j,b]
    memory, per segment g of the time axis between consecutive interval ends of region nodes:
        sum_{i alive in g} sum_a u[i,a] x[i,a] <= limit - max_{t in g} (load[t] of everything else)
    minimize  sum_i sum_a c'[i,a] x[i,a] + sum_e sum_ab M_e[a,b] y[e,a,b]

where ``c'`` adds to a node's cost its edges to fixed neighbours. Forbidden strategies and pairs
(cost >= FORBIDDEN) get no variable, except the current ones when ``keep_current``.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
from ortools.sat.python import cp_model

from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.local_search import State

__all__ = ["solve_region", "RegionResult", "region_size"]

_LOG = False


class RegionResult:
    """CP-SAT's status, whether the state changed, by how much it got cheaper, and ``bound``: no
    answer that agrees with the state outside the region has a lower core total (``-inf`` when
    CP-SAT proved nothing)."""

    def __init__(self, status: str, changed: bool, improvement: float = 0.0, bound: float = -np.inf):
        self.status, self.changed, self.improvement, self.bound = status, changed, improvement, bound


def region_size(core, region) -> int:
    """Variables the region's model would have (node strategies plus edge pairs inside)."""
    inside = set(region)
    total = 0
    for i in region:
        s = len(core.cost[i])
        total += s
        for j, m in core.nbrs[i]:
            if j in inside and i < j:
                total += m.size
    return total


def _clip(v: float) -> int:
    return int(min(v, FORBIDDEN))


def solve_region(state: State, region: list[int], time_limit_s: float, *, workers: int = 1,
                 keep_current: bool = True, seed: int = 0, deadline: Optional[float] = None) -> RegionResult:
    """Re-solve ``region`` optimally (within the time limit, and ending by ``deadline`` on the
    ``time.perf_counter`` clock when given: building a large model takes seconds of its own) and
    apply the answer to ``state`` when it is cheaper. Status is CP-SAT's ("OPTIMAL", "FEASIBLE",
    "INFEASIBLE", "UNKNOWN")."""
    core, ch = state.core, state.choice
    pos = {i: k for k, i in enumerate(region)}
    model = cp_model.CpModel()
    x: list[dict] = []
    obj_vars, obj_coefs = [], []
    const = 0.0  # what the objective leaves out: each node's lowest cost, constant edges
    for i in region:
        vec = core.cost[i].copy()
        for j, m in core.nbrs[i]:
            if j not in pos:
                vec += m[:, ch[j]]
        allowed = set(np.flatnonzero(vec < FORBIDDEN).tolist())
        if keep_current or not allowed:
            allowed.add(int(ch[i]))
        xs = {a: model.new_bool_var("") for a in sorted(allowed)}
        model.add_exactly_one(list(xs.values()))
        low = min(_clip(vec[a]) for a in xs)
        const += low
        for a, var in xs.items():
            if _clip(vec[a]) != low:
                obj_vars.append(var)
                obj_coefs.append(_clip(vec[a]) - low)
        x.append(xs)
    for i in region:
        xi = x[pos[i]]
        for j, m in core.nbrs[i]:
            if j not in pos or j < i:
                continue
            xj = x[pos[j]]
            sub = m[np.ix_(list(xi), list(xj))]
            if (sub == sub.flat[0]).all() and sub.flat[0] < FORBIDDEN:
                const += float(sub.flat[0])
                continue  # a constant edge cannot change the choice
            rows: dict = {a: [] for a in xi}
            cols: dict = {b: [] for b in xj}
            for ka, a in enumerate(xi):
                for kb, b in enumerate(xj):
                    c = sub[ka, kb]
                    if c < FORBIDDEN or (keep_current and a == ch[i] and b == ch[j]):
                        var = model.new_bool_var("")
                        rows[a].append(var)
                        cols[b].append(var)
                        if c:
                            obj_vars.append(var)
                            obj_coefs.append(_clip(c))
            for a, va in xi.items():
                model.add(sum(rows[a]) == va)
            for b, vb in xj.items():
                model.add(sum(cols[b]) == vb)
    _add_memory(model, state, region, x)
    model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coefs))
    for k, i in enumerate(region):
        for a, var in x[k].items():
            model.add_hint(var, a == ch[i])
    solver = cp_model.CpSolver()
    if deadline is not None:
        time_limit_s = min(time_limit_s, deadline - time.perf_counter())
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_s))
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    solver.parameters.log_search_progress = _LOG
    status = solver.solve(model)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return RegionResult(name, False)
    # the region's share of the total plus everything outside it, which the model held fixed
    bound = solver.best_objective_bound + const + state.total() - _region_cost(state, region, pos)
    new = [next(a for a, var in x[k].items() if solver.boolean_value(var)) for k in range(len(region))]
    before = _region_cost(state, region, pos)
    old = [int(ch[i]) for i in region]
    for i, a in zip(region, new):
        state.move(i, a)
    after = _region_cost(state, region, pos)
    fits = state.feasible() if core.limit is not None else True
    if (after < before and fits) or (not keep_current and fits):
        return RegionResult(name, after != before, before - after, bound)
    for i, a in zip(region, old):
        state.move(i, a)
    return RegionResult(name, False, bound=bound)


def _region_cost(state: State, region, pos) -> float:
    core, ch = state.core, state.choice
    t = 0.0
    for i in region:
        t += float(core.cost[i][ch[i]])
        for j, m in core.nbrs[i]:
            if j not in pos or i < j:
                t += float(m[ch[i], ch[j]])
    return t


def _add_memory(model, state: State, region, x) -> None:
    core = state.core
    if core.limit is None:
        return
    mem = []  # (i, lo, hi, {var: usage above the node's smallest}, smallest usage)
    for k, i in enumerate(region):
        lo, hi = int(core.lo[i]), int(core.hi[i])
        if lo >= hi:
            continue
        us = {a: float(core.usage[i][a]) for a in x[k]}
        if len(set(us.values())) > 1 or float(core.usage[i][state.choice[i]]) not in us.values():
            low = min(us.values())
            mem.append((i, lo, hi, {x[k][a]: u - low for a, u in us.items() if u != low}, low))
    if not mem:
        return
    t0 = min(m[1] for m in mem)
    t1 = max(m[2] for m in mem)
    own = np.zeros(t1 - t0 + 1)
    for i, lo, hi, _, _ in mem:
        u = core.usage[i][state.choice[i]]
        own[lo - t0] += u
        own[hi - t0] -= u
    others = state.load[t0:t1] - np.cumsum(own)[:-1]
    cuts = sorted({m[1] for m in mem} | {m[2] for m in mem})
    seen: dict = {}
    for g0, g1 in zip(cuts, cuts[1:]):
        alive = tuple(k for k, m in enumerate(mem) if m[1] <= g0 < m[2])
        if not alive:
            continue
        cap = core.limit - others[g0 - t0:g1 - t0].max() - sum(mem[k][4] for k in alive)
        if alive not in seen or cap < seen[alive]:
            seen[alive] = cap
    for alive, cap in seen.items():
        if sum(max(mem[k][3].values(), default=0.0) for k in alive) <= cap:
            continue  # cannot bind
        terms = [(var, int(round(u))) for k in alive for var, u in mem[k][3].items()]
        model.add(cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [c for _, c in terms])
                  <= int(np.floor(cap)))
