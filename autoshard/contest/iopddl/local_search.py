"""Local search on a presolved IOPDDL ``Core``: a state that keeps the memory load per time point,
a memory-safe start, and iterated conditional modes (ICM, Besag 1986) that never breaks the limit.

The load is an array over time points (``load[t]`` = base load + chosen usages alive at ``t``),
built once with a prefix-sum sweep and updated by slice adds; a move of node ``i`` from ``s`` to
``s'`` is allowed when ``u[i][s'] - u[i][s] <= limit - max(load[lo_i:hi_i])``.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.presolve import Core

__all__ = ["State", "min_memory_start", "min_cost_start", "greedy_start", "icm"]


class State:
    """A complete assignment on the core with its load profile; moves keep both in step."""

    def __init__(self, core: Core, choice):
        self.core = core
        self.choice = np.array(choice, dtype=np.int64)
        delta = np.zeros(len(core.base_load) + 1)
        for i in range(core.n):
            lo, hi = core.lo[i], core.hi[i]
            if lo < hi:
                u = core.usage[i][self.choice[i]]
                delta[lo] += u
                delta[hi] -= u
        self.load = core.base_load + np.cumsum(delta)[:-1]

    def local_costs(self, i: int) -> np.ndarray:
        """Cost of each strategy of node i given its neighbours' current choices."""
        vec = self.core.cost[i].copy()
        ch = self.choice
        for j, m in self.core.nbrs[i]:
            vec += m[:, ch[j]]
        return vec

    def slack(self, i: int) -> float:
        c = self.core
        if c.limit is None or c.lo[i] >= c.hi[i]:
            return math.inf
        return c.limit - self.load[c.lo[i]:c.hi[i]].max()

    def move(self, i: int, s: int) -> None:
        c = self.core
        if c.lo[i] < c.hi[i]:
            self.load[c.lo[i]:c.hi[i]] += c.usage[i][s] - c.usage[i][self.choice[i]]
        self.choice[i] = s

    def peak(self) -> float:
        return float(self.load.max(initial=0.0))

    def feasible(self) -> bool:
        return self.core.limit is None or self.peak() <= self.core.limit

    def total(self) -> float:
        """Cost of the assignment on the core (floats: for comparisons; the exact figure comes from
        ``problem.verify`` on the expanded answer)."""
        t, ch = tables(self.core), self.choice
        total = float(t["cost"][t["off"] + ch].sum())
        if len(t["ei"]):
            total += float(t["flat"][t["eoff"] + ch[t["ei"]] * t["sizes"][t["ej"]] + ch[t["ej"]]].sum())
        return total

    def improvable(self) -> list[int]:
        """Nodes with a strategy cheaper than their current one given their neighbours (memory not
        considered): where ICM has work, found for all nodes at once."""
        t, ch = tables(self.core), self.choice
        if self.core.n == 0:
            return []
        re, ra = t["row_e"], t["row_a"]  # every (edge, row of its first endpoint)
        ce, cb = t["col_e"], t["col_b"]  # every (edge, column of its second endpoint)
        ei, ej, sizes, eoff = t["ei"], t["ej"], t["sizes"], t["eoff"]
        to_i = t["flat"][eoff[re] + ra * sizes[ej[re]] + ch[ej[re]]]
        to_j = t["flat"][eoff[ce] + ch[ei[ce]] * sizes[ej[ce]] + cb]
        local = t["cost"] + np.bincount(np.concatenate([t["off"][ei[re]] + ra, t["off"][ej[ce]] + cb]),
                                        weights=np.concatenate([to_i, to_j]), minlength=len(t["cost"]))
        best = np.minimum.reduceat(local, t["off"])
        cur = local[t["off"] + ch]
        return np.flatnonzero(best < cur - 1e-9 * np.abs(cur)).tolist()


def tables(core: Core) -> dict:
    """Flat arrays of the core's costs (built once per core, kept in ``core.cache``): node costs
    ``cost`` at offsets ``off``, edges ``(ei[e], ej[e])`` with ``ei < ej`` and row-major matrices in
    ``flat`` from ``eoff[e]``, and the (edge, row) / (edge, column) pairs ``improvable`` gathers."""
    t = core.cache.get("tables")
    if t is not None:
        return t
    sizes = np.array([len(c) for c in core.cost], dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    ei, ej, mats = [], [], []
    for i in range(core.n):
        for j, m in core.nbrs[i]:
            if i < j:
                ei.append(i)
                ej.append(j)
                mats.append(m.ravel())
    ei, ej = np.array(ei, dtype=np.int64), np.array(ej, dtype=np.int64)
    msize = np.array([m.size for m in mats], dtype=np.int64)
    eoff = np.concatenate([[0], np.cumsum(msize)[:-1]]).astype(np.int64) if len(mats) else msize
    si, sj = sizes[ei], sizes[ej]
    row_e = np.repeat(np.arange(len(ei)), si)
    col_e = np.repeat(np.arange(len(ei)), sj)
    t = {"sizes": sizes, "off": off, "cost": np.concatenate(core.cost) if core.n else np.zeros(0),
         "ei": ei, "ej": ej, "eoff": eoff, "flat": np.concatenate(mats) if mats else np.zeros(0),
         "row_e": row_e, "row_a": np.arange(len(row_e)) - np.repeat(np.cumsum(si) - si, si),
         "col_e": col_e, "col_b": np.arange(len(col_e)) - np.repeat(np.cumsum(sj) - sj, sj)}
    core.cache["tables"] = t
    return t


def min_memory_start(core: Core) -> State:
    """Each node's smallest-usage strategy, the cheapest among ties: the start that fits whenever
    anything does ignoring edges."""
    choice = []
    for i in range(core.n):
        u = core.usage[i]
        alive = core.lo[i] < core.hi[i]
        choice.append(int(np.lexsort((core.cost[i], u))[0]) if alive else int(np.argmin(core.cost[i])))
    return State(core, choice)


def min_cost_start(core: Core) -> State:
    """Each node's cheapest strategy on its own (ignores edges and memory)."""
    return State(core, [int(np.argmin(c)) for c in core.cost])


def greedy_start(core: Core, *, respect_memory: bool = True, penalty: float = 0.0,
                 lookahead: bool = True, deadline: float = math.inf) -> State:
    """Decide nodes in breadth-first order from the highest-degree node of each component, each
    taking the cheapest strategy given its decided neighbours (so chains of must-agree edges stay
    consistent). Undecided nodes hold their smallest usage; with ``respect_memory`` a node may only
    grow into the free memory of its interval, so the result fits whenever the smallest-usage
    start does. ``penalty`` adds ``penalty * extra usage`` to a strategy's cost; ``lookahead``
    adds, per undecided neighbour, the cost of its best reply that fits its free memory."""
    state = min_memory_start(core)
    ch = state.choice
    decided = np.zeros(core.n, dtype=bool)
    order = []
    for root in sorted(range(core.n), key=lambda i: -len(core.nbrs[i])):
        if decided[root]:
            continue
        decided[root] = True
        queue = [root]
        k = 0
        while k < len(queue):
            i = queue[k]
            k += 1
            order.append(i)
            for j, _ in core.nbrs[i]:
                if not decided[j]:
                    decided[j] = True
                    queue.append(j)
    decided[:] = False
    for k, i in enumerate(order):
        if (k & 255) == 0 and time.perf_counter() > deadline:
            break  # the rest keep their smallest usage
        vec = core.cost[i].copy()
        for j, m in core.nbrs[i]:
            if decided[j]:
                vec += m[:, ch[j]]
            elif lookahead:  # the undecided neighbour's best answer within its free memory
                reply = core.cost[j][None, :] + m
                if respect_memory and core.limit is not None and core.lo[j] < core.hi[j]:
                    du = core.usage[j] - core.usage[j][ch[j]]
                    reply = reply + np.where(du <= state.slack(j), 0.0, FORBIDDEN)[None, :]
                vec += reply.min(axis=1)
        if core.lo[i] < core.hi[i]:
            du = core.usage[i] - core.usage[i][ch[i]]
            if penalty:
                vec = vec + penalty * du
            if respect_memory and core.limit is not None:
                vec = np.where(du <= state.slack(i), vec, np.inf)
        best = int(np.argmin(vec))
        if np.isfinite(vec[best]):
            state.move(i, best)
        decided[i] = True
    return state


def icm(state: State, deadline: float, *, respect_memory: bool = True, nodes: Optional[list] = None) -> int:
    """Move nodes to their best strategy given their neighbours (only moves that keep the memory
    limit when ``respect_memory``) until no move improves or ``deadline`` passes. Returns the
    number of moves."""
    core = state.core
    order = list(range(core.n)) if nodes is None else list(nodes)
    queued = np.zeros(core.n, dtype=bool)
    queued[order] = True
    moves = 0
    k = 0
    while k < len(order):
        if (k & 255) == 0 and time.perf_counter() > deadline:
            break
        i = order[k]
        k += 1
        queued[i] = False
        if len(core.cost[i]) == 1:
            continue
        vec = state.local_costs(i)
        cur = state.choice[i]
        if respect_memory and core.limit is not None and core.lo[i] < core.hi[i]:
            du = core.usage[i] - core.usage[i][cur]
            vec = np.where(du <= state.slack(i), vec, np.inf)
        best = int(np.argmin(vec))
        if vec[best] < vec[cur]:
            state.move(i, best)
            moves += 1
            for j, _ in core.nbrs[i]:
                if not queued[j]:
                    queued[j] = True
                    order.append(j)
    return moves
