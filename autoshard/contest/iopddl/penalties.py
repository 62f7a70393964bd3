"""The memory limit as adaptive penalties (soft constraints), the priced problem solved as a
weighted CSP by toulbar2 (``wcsp``); and a Lagrangian lower bound.

**Penalties.** Node ``i`` pays ``w[i] * (usage[i][s] - min usage of i)`` for strategy ``s``. After
each solve, a node whose interval overflows the limit in the decoded answer ("broken") has its
weight raised, one whose interval fits has it lowered: a per-node bisection between the largest
weight seen broken and the smallest seen fitting (bracket widened by ``grow`` while one side is
missing), so memory is priced only where it binds. A global scale factor multiplies all weights;
each call of ``PenaltySearch.step`` draws it around 1 (log-normal, ``spread``) so successive
answers differ. Every decoded answer is repaired (``lagrangian.repair``: cheapest memory per cost
at the peak first), polished by memory-safe ICM and returned; callers keep the good ones in a pool.

**Lower bound.** For prices ``lam[t] >= 0`` per time point, every answer ``x`` that keeps the
limit costs at least ``L(lam) = min_x [cost(x) + sum_t lam[t] (load_t(x) - limit)]`` (weak
duality); toulbar2's dual bound of the priced network (costs rounded down) is a lower bound of
that minimum, so ``lower_bound`` is one of the problem's optimum. Prices are ``kappa`` on the
time points where the memory-free answer overflows, for a few ``kappa``: the best bound wins.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np

from autoshard.contest.iopddl.lagrangian import MemoryIndex, node_prices, repair
from autoshard.contest.iopddl.local_search import State, icm
from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.wcsp import WcspModel

__all__ = ["PenaltySearch", "lower_bound", "interval_peaks"]


def interval_peaks(state: State) -> np.ndarray:
    """Per core node, the largest load over its interval (``-inf`` for empty intervals), all at
    once: a sparse table of maxima over the load profile (O(T log T) to build, O(1) a query)."""
    core, load = state.core, state.load
    out = np.full(core.n, -np.inf)
    ok = core.lo < core.hi
    if not ok.any() or len(load) == 0:
        return out
    table = [load]
    k = 1
    while 2 * k <= len(load):
        prev = table[-1]
        table.append(np.maximum(prev[:len(prev) - k], prev[k:]))
        k *= 2
    lo, hi = core.lo[ok], np.minimum(core.hi[ok], len(load))
    length = hi - lo
    level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    res = np.empty(len(lo))
    for lv in np.unique(level):
        sel = level == lv
        row = table[lv]
        res[sel] = np.maximum(row[lo[sel]], row[hi[sel] - (1 << lv)])
    out[ok] = res
    return out


class PenaltySearch:
    """Per-node memory weights with their brackets, and the toulbar2 model of the core."""

    def __init__(self, core, model: Optional[WcspModel] = None, *, scale: Optional[float] = None,
                 grow: float = 4.0, spread: float = 0.5, seed: int = 0):
        self.core = core
        self.model = model or WcspModel(core)
        self.index = MemoryIndex(core)
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.grow, self.spread = grow, spread
        n = core.n
        self.umin = np.array([u.min() if len(u) else 0.0 for u in core.usage])
        self.rel = np.zeros(n, dtype=bool)  # nodes whose usage can change and matters
        self.rel[self.index.nodes] = True
        self.above = np.concatenate(core.usage) - np.repeat(self.umin, self.model.sizes) if n else np.zeros(0)
        if scale is None:  # cost per unit of memory: the problem's own exchange rate
            total = float(sum(np.median(c[c < FORBIDDEN]) if (c < FORBIDDEN).any() else 0.0 for c in core.cost))
            scale = max(total, 1.0) / max(core.limit or 1.0, 1.0)
        self.w = np.where(self.rel, scale, 0.0)
        self.lb = np.zeros(n)               # largest weight seen broken
        self.ub = np.full(n, np.inf)        # smallest weight seen fitting
        self.rounds = 0

    def extra(self, w: np.ndarray) -> np.ndarray:
        return np.repeat(w, self.model.sizes) * self.above

    def step(self, deadline: float, time_limit_s: float) -> Optional[State]:
        """One priced solve at the current weights (times a random global factor), the brackets
        updated from the decoded answer, which is returned repaired and polished (None when
        toulbar2 found nothing or the repair failed)."""
        core = self.core
        factor = float(np.exp(self.rng.normal(0.0, self.spread))) if self.rounds else 1.0
        self.rounds += 1
        res = self.model.solve(self.extra(self.w * factor), time_limit_s, seed=self.seed + self.rounds)
        if res.choice is None:
            return None
        state = State(core, res.choice)
        if core.limit is not None:
            self._update(interval_peaks(state) > core.limit, factor)
            if not repair(state, self.index, deadline):
                return None
        icm(state, deadline, nodes=state.improvable())
        if not state.feasible() or state.total() >= FORBIDDEN:
            return None
        return state

    def _update(self, broken: np.ndarray, factor: float) -> None:
        w = self.w * factor
        rel = self.rel
        b, f = broken & rel, ~broken & rel
        self.lb[b] = np.maximum(self.lb[b], w[b])
        self.ub[f] = np.minimum(self.ub[f], w[f])
        self.ub[b] = np.maximum(self.ub[b], self.lb[b])  # a bracket the answer contradicted: reopen it
        self.ub[b & (self.ub <= self.lb)] = np.inf
        lo, hi = self.lb, self.ub
        new = np.where(np.isfinite(hi) & (lo > 0), np.sqrt(np.maximum(lo, 1e-300) * hi), self.w)
        new = np.where(~np.isfinite(hi), np.maximum(w, lo) * self.grow, new)
        new = np.where(np.isfinite(hi) & (lo == 0), hi / self.grow, new)
        self.w = np.where(rel, new, 0.0)


def lower_bound(core, model: WcspModel, free: State, deadline: float, *, time_limit_s: float = 2.0,
                kappas=(1.0, 10.0, 100.0), refine: bool = True, on_step=None) -> float:
    """The best Lagrangian bound found before ``deadline`` (see the module docstring) on the core's
    total (``State.total``); ``-inf`` when none was computed. ``free`` is a memory-free answer: its
    overflowing time points carry the prices, ``kappa`` times the problem's cost per memory-time,
    for each of ``kappas`` and then (``refine``) a third and three times the best of them.
    ``on_step(best bound so far)`` is called after each priced solve."""
    if core.limit is None:
        return model.solve(np.zeros(model.size), time_limit_s, floor=True).bound
    hot = (free.load > core.limit).astype(np.float64)
    length = np.maximum(core.hi - core.lo, 0)
    memtime = float(sum(core.usage[i][free.choice[i]] * length[i] for i in range(core.n)))
    p0 = max(free.total(), 1.0) / max(memtime, 1.0)
    usage = np.concatenate(core.usage)
    tried: dict = {}

    def bound_at(k: float) -> float:
        lam = k * p0 * hot
        extra = np.repeat(node_prices(core, lam), model.sizes) * usage
        res = model.solve(extra, time_limit_s, floor=True)
        # the constant of the relaxation: prices times (load of removed nodes - limit)
        tried[k] = res.bound + float(np.dot(lam, core.base_load - core.limit))
        if on_step:
            on_step(max(tried.values()))
        return tried[k]

    for k in kappas:
        if time.perf_counter() + time_limit_s > deadline:
            break
        bound_at(k)
    if refine and tried:
        top = max(tried, key=tried.get)
        for k in (top / 3.0, top * 3.0):
            if time.perf_counter() + time_limit_s > deadline:
                break
            bound_at(k)
    return max(tried.values(), default=-math.inf)
