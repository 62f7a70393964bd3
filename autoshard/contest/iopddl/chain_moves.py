"""Cluster moves (ejection chains): change one node's strategy and let its neighbours follow.

Where edges make neighbours agree (a costly or forbidden pair on every mismatch), moving one node
alone never pays, so single-node search (ICM) stops; the whole chain has to move at once. A
chain move sets node ``i`` to strategy ``s``, then visits the neighbours of every moved node
breadth-first and moves each to its best strategy given the others' current (tentative) ones,
up to ``max_nodes`` nodes; the move is kept when the total cost fell, else undone. The total
change is exact: it is the sum of each step's change of the moved node's local cost.

Memory is checked as the chain grows, never by a rescan: a ``SegmentTree`` holds the load
profile; each tentative step adds its usage change over its interval, and a node may only take a
strategy whose extra usage fits ``limit - max(load over its interval)`` (one range maximum), so
every kept chain keeps the limit.
"""
from __future__ import annotations

import random
import time

import numpy as np

from autoshard.contest.iopddl.local_search import State
from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.segment_tree import SegmentTree

__all__ = ["ChainSearch"]


class ChainSearch:
    """Chain moves on ``state`` (kept in step with it: ``state.move`` is used for kept moves)."""

    def __init__(self, state: State):
        self.state = state
        self.core = core = state.core
        self.tree = SegmentTree(state.load)
        self.limit = np.inf if core.limit is None else float(core.limit)
        self.mem = [bool(core.lo[i] < core.hi[i] and np.ptp(core.usage[i]) > 0) for i in range(core.n)]
        self.movable = [i for i in range(core.n) if len(core.cost[i]) > 1]

    def _allowed(self, j: int, cur: int) -> np.ndarray:
        """Strategies of ``j`` whose extra usage fits the free memory of its interval now."""
        core = self.core
        us = core.usage[j]
        if not self.mem[j] or self.limit == np.inf:
            return np.ones(len(us), dtype=bool)
        slack = self.limit - self.tree.max(int(core.lo[j]), int(core.hi[j]))
        return us - us[cur] <= slack + 1e-9 * abs(self.limit)

    def _step(self, j: int, s: int, log: list) -> None:
        core, ch = self.core, self.state.choice
        a = int(ch[j])
        if self.mem[j]:
            self.tree.add(int(core.lo[j]), int(core.hi[j]), float(core.usage[j][s] - core.usage[j][a]))
        ch[j] = s
        log.append((j, a, s))

    def _undo(self, log: list) -> None:
        core, ch = self.core, self.state.choice
        for j, a, s in reversed(log):
            if self.mem[j]:
                self.tree.add(int(core.lo[j]), int(core.hi[j]), float(core.usage[j][a] - core.usage[j][s]))
            ch[j] = a

    def try_chain(self, i: int, s: int, max_nodes: int = 24) -> float:
        """Move ``i`` to ``s`` and let neighbours follow (see the module docstring); returns the
        cost decrease when the chain was kept, 0.0 when it was undone."""
        state, core = self.state, self.core
        cur = int(state.choice[i])
        if s == cur or not self._allowed(i, cur)[s]:
            return 0.0
        vec = state.local_costs(i)
        if vec[s] >= FORBIDDEN:
            return 0.0
        log: list = []
        delta = float(vec[s] - vec[cur])
        self._step(i, s, log)
        queue = [j for j, _ in core.nbrs[i]]
        seen = {i}
        k = 0
        while k < len(queue) and len(log) < max_nodes:
            j = queue[k]
            k += 1
            if j in seen or len(core.cost[j]) == 1:
                continue
            seen.add(j)
            a = int(state.choice[j])
            vec = np.where(self._allowed(j, a), state.local_costs(j), np.inf)
            b = int(np.argmin(vec))
            if vec[b] < vec[a]:
                delta += float(vec[b] - vec[a])
                self._step(j, b, log)
                queue.extend(q for q, _ in core.nbrs[j] if q not in seen)
        if delta < -1e-9 * max(1.0, abs(delta)):
            for j, a, b in log:  # keep: bring the state's own load profile in step
                state.choice[j] = a
                state.move(j, b)
            return -delta
        self._undo(log)
        return 0.0

    def run(self, deadline: float, rng: random.Random, *, max_nodes: int = 24, nodes=None) -> tuple[int, float]:
        """Chain moves from random nodes (of ``nodes``, default all), each trying every other
        strategy, until ``deadline``; returns (chains kept, total cost decrease)."""
        pool = list(nodes) if nodes is not None else self.movable
        kept, gain = 0, 0.0
        if not pool:
            return kept, gain
        k = 0
        while True:
            if (k & 15) == 0 and time.perf_counter() > deadline:
                break
            k += 1
            i = pool[rng.randrange(len(pool))]
            for s in rng.sample(range(len(self.core.cost[i])), len(self.core.cost[i])):
                g = self.try_chain(i, s, max_nodes)
                if g > 0:
                    kept += 1
                    gain += g
                    break
            if k > 50 * len(pool):
                break
        return kept, gain
