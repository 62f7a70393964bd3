"""Exact reductions of an IOPDDL problem before search, and the compact ``Core`` the search works on.

Rules, applied until none fires (each keeps at least one optimal answer):

* **forbidden**: strategies whose node cost is at or above ``FORBIDDEN`` go, unless all are, and so do
  strategies every neighbour choice forbids through one edge;
* **dominance**: strategy ``s`` goes when some ``t`` costs no more, uses no more memory (memory only
  counts when the node's interval is non-empty) and meets every neighbour strategy at no higher
  edge cost (rows of all incident matrices compared elementwise);
* **single strategy**: a node left with one strategy folds its edge rows into its neighbours' costs
  and its usage into a fixed base load;
* **memory-free nodes** (empty interval, or the same usage for every strategy left): with no edge the
  cheapest strategy is fixed; with one neighbour the node folds into it (``cost_u[a] += min_b
  (cost_v[b] + M[a, b])``, edge-cost absorption); with two neighbours ``u, w`` it is replaced by the
  edge ``N[a, c] = min_b (M_uv[a, b] + cost_v[b] + M_vw[b, c])`` (series reduction, chains collapse).

Every fold records an argmin table over its hosts' strategies, so ``Core.expand`` maps an answer on
the reduced graph back to one original strategy index per node, replaying the folds in reverse.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN, Problem

__all__ = ["Core", "presolve"]

_SERIES_MAX = 2_000_000  # largest |S_u| x |S_v| x |S_w| block a series reduction may build
_DOMINANCE_BLOCK = 4_000_000  # pairwise dominance compared in one array up to this many entries
_HUB_DEGREE = 64         # nodes with more neighbours are checked for dominance at most twice


@dataclass
class Core:
    """The reduced problem, nodes renumbered ``0..n-1``: float costs, usages, intervals, neighbour
    lists ``nbrs[i] = [(j, M)]`` with ``M`` shaped ``|S_i| x |S_j|``, the load of removed nodes
    (``base_load[t]``) and the limit (``None``: no limit)."""
    cost: list
    usage: list
    lo: np.ndarray
    hi: np.ndarray
    nbrs: list
    base_load: np.ndarray
    limit: Optional[float]
    _orig: list
    _strat: list
    _folds: list
    _fixed: dict
    _num_orig: int
    cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # derived arrays

    @property
    def n(self) -> int:
        return len(self.cost)

    def expand(self, choice) -> list[int]:
        """One original strategy index per original node from one local index per core node."""
        local = np.full(self._num_orig, -1, dtype=np.int64)
        for k, i in enumerate(self._orig):
            local[i] = choice[k]
        for v, s in self._fixed.items():
            local[v] = s
        for v, hosts, table in reversed(self._folds):
            local[v] = table[tuple(int(local[h]) for h in hosts)]
        return [int(self._strat[i][local[i]]) for i in range(self._num_orig)]


class _Reducer:
    def __init__(self, p: Problem):
        n = p.num_nodes
        self.cost = [np.asarray(c, dtype=np.float64) for c in p.costs]
        self.usage = [np.asarray(u, dtype=np.float64) for u in p.usages]
        self.lo = np.array([iv[0] for iv in p.intervals], dtype=np.int64)
        self.hi = np.array([iv[1] for iv in p.intervals], dtype=np.int64)
        self.strat = [np.arange(len(c)) for c in p.costs]
        self.adj: list[dict] = [dict() for _ in range(n)]
        for (u, v), m in zip(p.edges, p.edge_costs):
            mat = np.asarray(m, dtype=np.float64).reshape(len(p.costs[u]), len(p.costs[v]))
            if u == v:
                self.cost[u] = self.cost[u] + np.diag(mat)
                continue
            self._add_edge(u, v, mat)
        self.alive = [True] * n
        self.folds: list[list] = []
        self.folds_by_host: dict[int, list[list]] = {}
        self.fixed: dict[int, int] = {}
        self.base: dict[int, float] = {}

    def _add_edge(self, u, v, mat):
        if v in self.adj[u]:
            mat = self.adj[u][v] + mat
        self.adj[u][v] = mat
        self.adj[v][u] = mat.T

    def _drop_edges(self, v):
        for w in self.adj[v]:
            del self.adj[w][v]
        self.adj[v] = {}

    def _memory_matters(self, v) -> bool:
        u = self.usage[v]
        return bool(self.lo[v] < self.hi[v] and u.min() != u.max())

    def _add_base(self, v, amount):
        if self.lo[v] < self.hi[v] and amount:
            lo, hi = int(self.lo[v]), int(self.hi[v])
            self.base[lo] = self.base.get(lo, 0.0) + amount
            self.base[hi] = self.base.get(hi, 0.0) - amount

    def _restrict(self, v, keep):
        self.cost[v], self.usage[v], self.strat[v] = self.cost[v][keep], self.usage[v][keep], self.strat[v][keep]
        for w, m in self.adj[v].items():
            self.adj[v][w] = m[keep]
            self.adj[w][v] = self.adj[v][w].T
        for rec in self.folds_by_host.get(v, ()):
            rec[2] = np.take(rec[2], keep, axis=rec[1].index(v))

    def prune(self, v) -> bool:
        """Forbidden and dominated strategies of v; True when any went."""
        s = len(self.cost[v])
        if s == 1:
            return False
        ok = self.cost[v] < FORBIDDEN
        for m in self.adj[v].values():
            ok &= m.min(axis=1) < FORBIDDEN
        if not ok.any():
            ok[:] = True
        cols = [self.cost[v][:, None]]
        if self.lo[v] < self.hi[v]:
            cols.append(self.usage[v][:, None])
        cols.extend(self.adj[v].values())
        key = np.concatenate(cols, axis=1)
        if s * s * key.shape[1] <= _DOMINANCE_BLOCK:
            le = (key[:, None, :] <= key[None, :, :]).all(axis=2)  # le[t, s]: t is nowhere worse than s
            strict = le & ~le.T
            dominated = strict.any(axis=0) | np.triu(le & le.T, 1).any(axis=0)
            keep = ok & ~dominated
        elif s * s * key.shape[1] > 50 * _DOMINANCE_BLOCK:
            keep = ok  # too costly to compare (hundreds of strategies times wide rows): forbidden only
        else:
            keep = ok.copy()
            for t in range(s):
                if keep[t]:
                    dominated = (key[t] <= key).all(axis=1) & keep
                    dominated[t] = False
                    keep &= ~dominated
        if not keep.any():
            keep = ok
        if keep.all():
            return False
        self._restrict(v, np.flatnonzero(keep))
        return True

    def reduce(self, v) -> list[int]:
        """Remove v if a folding rule applies; returns the nodes whose neighbourhood changed."""
        nb = list(self.adj[v])
        if len(self.cost[v]) == 1:
            for w in nb:
                self.cost[w] = self.cost[w] + self.adj[w][v][:, 0]
            self._add_base(v, self.usage[v][0])
            self._drop_edges(v)
            self.fixed[v] = 0
        elif self._memory_matters(v):
            return []
        elif not nb:
            self._add_base(v, self.usage[v][0])
            self.fixed[v] = int(np.argmin(self.cost[v]))
        elif len(nb) == 1:
            (u,) = nb
            total = self.adj[u][v] + self.cost[v][None, :]
            self._fold(v, (u,), np.argmin(total, axis=1))
            self.cost[u] = self.cost[u] + total.min(axis=1)
            self._add_base(v, self.usage[v][0])
            self._drop_edges(v)
        elif len(nb) == 2:
            u, w = nb
            a, b = self.adj[u][v], self.adj[v][w]
            if a.shape[0] * a.shape[1] * b.shape[1] > _SERIES_MAX:
                return []
            total = a[:, :, None] + self.cost[v][None, :, None] + b[None, :, :]
            self._fold(v, (u, w), np.argmin(total, axis=1))
            self._add_base(v, self.usage[v][0])
            self._drop_edges(v)
            self._add_edge(u, w, total.min(axis=1))
        else:
            return []
        self.alive[v] = False
        return nb

    def _fold(self, v, hosts, table):
        rec = [v, hosts, table]
        self.folds.append(rec)
        for h in hosts:
            self.folds_by_host.setdefault(h, []).append(rec)

    def run(self, deadline: float):
        work = list(range(len(self.cost)))
        queued = [True] * len(self.cost)
        pruned = [0] * len(self.cost)
        steps = 0
        while work:
            steps += 1
            if (steps & 1023) == 0 and time.perf_counter() > deadline:
                return  # what is reduced so far stays exact; the rest is searched unreduced
            v = work.pop()
            queued[v] = False
            if not self.alive[v]:
                continue
            # a hub's dominance check spans all its neighbours' strategies; redoing it each time one
            # neighbour changes made presolve quadratic in the degree
            big = len(self.adj[v]) > _HUB_DEGREE
            changed = False if big and pruned[v] >= 2 else self.prune(v)
            pruned[v] += 1
            touched = self.reduce(v)
            if changed and self.alive[v]:
                touched = list(self.adj[v])
            for w in touched:
                if self.alive[w] and not queued[w]:
                    queued[w] = True
                    work.append(w)


def presolve(p: Problem, *, reduce: bool = True, deadline: float = math.inf) -> Core:
    """Apply the reductions (``reduce=False``: only build the core; they stop, still exact, at
    ``deadline`` on the ``time.perf_counter`` clock) and return the ``Core``."""
    r = _Reducer(p)
    if reduce:
        r.run(deadline)
    keep = [i for i in range(len(r.cost)) if r.alive[i]]
    index = {old: k for k, old in enumerate(keep)}
    nbrs = [[(index[j], m) for j, m in r.adj[i].items()] for i in keep]
    horizon = int(max(r.hi.max(initial=0), max(r.base, default=0))) + 1
    delta = np.zeros(horizon + 1)
    for t, a in r.base.items():
        delta[t] += a
    base = np.cumsum(delta)[:horizon]
    limit = None if p.usage_limit is None else float(p.usage_limit)
    return Core([r.cost[i] for i in keep], [r.usage[i] for i in keep], r.lo[keep], r.hi[keep], nbrs, base,
                limit, keep, r.strat, [tuple(f) for f in r.folds], r.fixed, len(r.cost))
