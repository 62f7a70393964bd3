"""Exact block moves on random induced forests: dynamic programming (min-sum message passing,
exact on trees) over a random set of nodes whose induced subgraph has no cycle, everything else
fixed at the current state. One move changes whole chains and subtrees at once, which single-node
ICM cannot do when edges force neighbours to agree (a forbidden or costly pair on every mismatch).

Memory: with ``respect_memory`` a node of the forest may only raise its usage by ``slack_i / k_i``,
where ``slack_i`` is the free memory in its interval and ``k_i`` the largest number of forest nodes
alive at one time point of that interval, so the move keeps the limit whatever the forest picks.
"""
from __future__ import annotations

import random

import numpy as np

from autoshard.contest.iopddl.local_search import State

__all__ = ["random_forest", "forest_move"]


def random_forest(core, rng: random.Random, *, hubs_first: bool = False) -> list[int]:
    """Nodes in random order (``hubs_first``: by degree times a random factor, so high-degree nodes
    and their stars get in), each kept when its kept neighbours lie in distinct trees (union-find),
    so the kept set induces a forest."""
    order = list(range(core.n))
    if hubs_first:
        key = [-len(core.nbrs[i]) * (0.5 + rng.random()) for i in order]
        order.sort(key=key.__getitem__)
    else:
        rng.shuffle(order)
    parent = list(range(core.n))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    inside = np.zeros(core.n, dtype=bool)
    kept = []
    for i in order:
        roots = [find(j) for j, _ in core.nbrs[i] if inside[j]]
        if len(roots) != len(set(roots)):
            continue
        inside[i] = True
        kept.append(i)
        for r in roots:
            parent[r] = i
    return kept


def forest_move(state: State, forest: list[int], *, respect_memory: bool = True) -> float:
    """Give the forest's nodes their jointly optimal strategies (others fixed); returns the cost
    decrease (0.0 when nothing changed)."""
    core, ch = state.core, state.choice
    inside = np.zeros(core.n, dtype=bool)
    inside[forest] = True
    allow_extra = None
    if respect_memory and core.limit is not None:
        allow_extra = _memory_allowance(state, forest)
    unary = {}
    for i in forest:
        u = core.cost[i].copy()
        for j, m in core.nbrs[i]:
            if not inside[j]:
                u += m[:, ch[j]]
        if allow_extra is not None and i in allow_extra:
            du = core.usage[i] - core.usage[i][ch[i]]
            u[du > allow_extra[i]] = np.inf
        unary[i] = u
    seen = np.zeros(core.n, dtype=bool)
    before = after = 0.0
    changes = []
    for root in forest:
        if seen[root]:
            continue
        order, par, pmat = [root], {root: -1}, {}
        seen[root] = True
        k = 0
        while k < len(order):
            i = order[k]
            k += 1
            for j, m in core.nbrs[i]:
                if inside[j] and not seen[j]:
                    seen[j] = True
                    par[j] = i
                    pmat[j] = m  # |S_parent| x |S_child|
                    order.append(j)
        belief = {i: unary[i].copy() for i in order}
        arg = {}
        for i in reversed(order[1:]):
            tot = pmat[i] + belief[i][None, :]
            arg[i] = tot.argmin(axis=1)
            belief[par[i]] += tot.min(axis=1)
        new = {root: int(np.argmin(belief[root]))}
        if not np.isfinite(belief[root][new[root]]):
            continue
        for i in order[1:]:
            new[i] = int(arg[i][new[par[i]]])
        cur = {i: int(ch[i]) for i in order}
        before_t = _tree_cost(unary, pmat, par, order, cur)
        after_t = _tree_cost(unary, pmat, par, order, new)
        if after_t < before_t:
            before += before_t
            after += after_t
            changes.extend((i, new[i]) for i in order if new[i] != cur[i])
    for i, s in changes:
        state.move(i, s)
    return before - after


def _tree_cost(unary, pmat, par, order, pick) -> float:
    t = 0.0
    for i in order:
        t += unary[i][pick[i]]
        if par[i] >= 0:
            t += pmat[i][pick[par[i]], pick[i]]
    return t


def _memory_allowance(state: State, forest) -> dict:
    """Per memory-relevant forest node, how much its usage may grow (see the module docstring)."""
    core = state.core
    mem = [i for i in forest if core.lo[i] < core.hi[i] and np.ptp(core.usage[i]) > 0]
    if not mem:
        return {}
    delta = np.zeros(len(state.load) + 1)
    lo = core.lo[mem]
    hi = core.hi[mem]
    np.add.at(delta, lo, 1)
    np.add.at(delta, hi, -1)
    count = np.cumsum(delta)[:-1]
    free = core.limit - state.load
    out = {}
    for i, a, b in zip(mem, lo, hi):
        out[i] = max(0.0, free[a:b].min()) / max(1.0, count[a:b].max())
    return out
