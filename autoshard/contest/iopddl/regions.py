"""Neighbourhoods for the CP-SAT large-neighbourhood search on a presolved IOPDDL ``Core``.

A region is a list of core nodes re-solved together (everything else fixed). Its size is counted
the way the model of ``neighbourhood_search`` grows: a node adds its strategies plus one variable per entry of
each matrix to a node already inside. High-degree nodes (a hub with thousands of neighbours is
common: one weight feeding every layer) would swallow the whole budget or, counted by degree, stop
a region at two nodes; so growth takes at most ``fanout`` random neighbours of any node, and a hub
only enters when its edges into the region fit.

>>> from autoshard.contest.iopddl.problem import Problem
>>> from autoshard.contest.iopddl.presolve import presolve
>>> import random
>>> p = Problem([[1, 2]] * 4, [[1, 1]] * 4, [(0, 1)] * 4, [(0, 1), (1, 2), (2, 3)], [[0, 1, 1, 0]] * 3, 9)
>>> core = presolve(p, reduce=False)
>>> sorted(bfs_region(core, 0, 100, random.Random(0)))
[0, 1, 2, 3]
>>> len(bfs_region(core, 0, 8, random.Random(0)))   # 2 + (2 + 4) variables; a third would need 6 more
2
"""
from __future__ import annotations

import random
from typing import Iterable, Optional

import numpy as np

__all__ = ["RegionBuilder", "adjacency", "bfs_region", "time_region"]


def adjacency(core) -> list[dict]:
    """``adj[i][j]``: the matrix of edge (i, j), ``|S_i| x |S_j|`` (built once per core)."""
    return [dict(nb) for nb in core.nbrs]


class RegionBuilder:
    """Grows a region node by node, keeping the model's variable count (see the module docstring)."""

    def __init__(self, core, max_vars: int, adj: Optional[list] = None):
        self.core, self.max_vars = core, max_vars
        self.adj = adj if adj is not None else adjacency(core)
        self.inside: set[int] = set()
        self.region: list[int] = []
        self.vars = 0

    def cost_of(self, j: int) -> int:
        aj, inside = self.adj[j], self.inside
        extra = len(self.core.cost[j])
        if len(aj) <= len(inside):
            for k, m in aj.items():
                if k in inside:
                    extra += m.size
        else:
            for k in inside:
                m = aj.get(k)
                if m is not None:
                    extra += m.size
        return extra

    def try_add(self, j: int) -> bool:
        """Add ``j`` when it fits (and is not inside yet); True when added."""
        if j in self.inside:
            return False
        c = self.cost_of(j)
        if self.vars + c > self.max_vars and self.region:
            return False
        self.inside.add(j)
        self.region.append(j)
        self.vars += c
        return True

    def full(self) -> bool:
        return self.vars >= 0.95 * self.max_vars

    def grow(self, seeds: Iterable[int], rng: random.Random, fanout: int = 24, misses: int = 64) -> list[int]:
        """Breadth-first from ``seeds`` (already inside or not), in random order, until the budget is
        met or ``misses`` candidates in a row did not fit."""
        frontier = list(seeds)
        for j in frontier:
            self.try_add(j)
        k = miss = 0
        frontier = [j for j in frontier if j in self.inside]
        while k < len(frontier) and not self.full() and miss < misses:
            i = frontier[k]
            k += 1
            nb = self.core.nbrs[i]
            pick = range(len(nb)) if len(nb) <= fanout else rng.sample(range(len(nb)), fanout)
            pick = list(pick)
            rng.shuffle(pick)
            for q in pick:
                j = nb[q][0]
                if j in self.inside:
                    continue
                if self.try_add(j):
                    frontier.append(j)
                    miss = 0
                else:
                    miss += 1
                if self.full() or miss >= misses:
                    break
        return self.region


def bfs_region(core, seed: int, max_vars: int, rng: random.Random, fanout: int = 24,
               adj: Optional[list] = None) -> list[int]:
    """A connected region around ``seed`` with about ``max_vars`` CP-SAT variables."""
    return RegionBuilder(core, max_vars, adj).grow([seed], rng, fanout)


def time_region(state, alive_at, max_vars: int, rng: random.Random, hot: int = 64,
                adj: Optional[list] = None) -> list[int]:
    """Nodes alive at one of the ``hot`` most loaded time points whose usage can change (half the
    budget, random order), grown along edges with the rest: the moves that trade memory at the
    peak for cost elsewhere."""
    load = state.load
    top = np.argpartition(load, -hot)[-hot:] if len(load) > hot else np.arange(len(load))
    t = int(top[rng.randrange(len(top))])
    alive = alive_at(t)
    rng.shuffle(alive)
    b = RegionBuilder(state.core, max_vars // 2, adj)
    for i in alive:
        b.try_add(i)
        if b.full():
            break
    b.max_vars = max_vars
    return b.grow(list(b.region), rng)
