"""The search used without toulbar2 (or when it finds nothing in time): a memory-safe greedy
start, and large-neighbourhood search alternating exact forest moves (``forest_moves``) with
CP-SAT neighbourhoods (``neighbourhood_search``, shaped by ``regions``) aimed first at forbidden
costs, then at costly edges and busy time points. ``cfg`` is the solver's ``SearchConfig``.
"""
from __future__ import annotations

import random
import time

import numpy as np

from autoshard.contest.iopddl.forest_moves import forest_move, random_forest
from autoshard.contest.iopddl.local_search import State, greedy_start, icm, min_memory_start
from autoshard.contest.iopddl.neighbourhood_search import solve_region
from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.regions import adjacency, bfs_region, time_region

__all__ = ["memory_safe_start", "lns"]


def memory_safe_start(core, deadline, penalties=(10.0, 3.0, 1.0, 30.0, 0.0)) -> State:
    """A memory-safe start: breadth-first greedy with lookahead inside the free memory, polished by
    ICM, for several prices of memory (cost units per usage unit) until one meets no forbidden
    cost and a third of the time left is used; the best (fewest forbidden, then cheapest) wins."""
    budget_end = time.perf_counter() + (deadline - time.perf_counter()) / 3
    best, best_key = None, None
    for k, penalty in enumerate(penalties):
        state = greedy_start(core, penalty=penalty, deadline=deadline)
        if not state.feasible():
            state = min_memory_start(core)
        icm(state, deadline)
        key = (len(_bad_nodes(state)), state.total())
        if best_key is None or key < best_key:
            best, best_key = state, key
        if (best_key[0] == 0 and k >= 1) or time.perf_counter() > budget_end:
            break
    return best


def _bad_nodes(state: State) -> list[int]:
    """Nodes whose current strategy meets a forbidden cost (their own or on an edge)."""
    return _scan(state)[0]


def _scan(state: State, hot: int = 32) -> tuple[list[int], list[int]]:
    """(nodes meeting a forbidden cost, endpoints of the ``hot`` most expensive edges now)."""
    core, ch = state.core, state.choice
    bad, edges = [], []
    for i in range(core.n):
        worst = core.cost[i][ch[i]]
        for j, m in core.nbrs[i]:
            c = m[ch[i], ch[j]]
            worst = max(worst, c)
            if i < j and c > 0:
                edges.append((c, i, j))
        if worst >= FORBIDDEN:
            bad.append(i)
    edges.sort(reverse=True)
    return bad, [k for _, i, j in edges[:hot] for k in (i, j)]


def lns(state: State, deadline_fn, cfg, rng: random.Random, offer) -> dict:
    """Alternate exact forest moves (``cfg.forest_share`` of the time) and CP-SAT neighbourhoods: around
    nodes that still meet a forbidden cost first, else around the currently most expensive edges,
    a busy time point or a random node."""
    core = state.core
    n = core.n
    mem_nodes = [i for i in range(n) if core.lo[i] < core.hi[i] and np.ptp(core.usage[i]) > 0]
    mem_lo, mem_hi = core.lo[mem_nodes], core.hi[mem_nodes]
    mem_arr = np.array(mem_nodes, dtype=np.int64)

    def alive_at(t):
        return mem_arr[(mem_lo <= t) & (t < mem_hi)].tolist()

    adj = adjacency(core)
    size = cfg.region_vars
    tries = wins = forests = 0
    lns_s = 0.0
    bad: list[int] = []
    hot: list[int] = []
    last_offer = time.perf_counter()
    forest_s, overhead_s = 0.0, 0.1
    while True:
        deadline = deadline_fn()
        now = time.perf_counter()
        if now + overhead_s + 0.1 > deadline:
            break
        share = cfg.forest_share_bad if bad else cfg.forest_share
        if (tries == 0 or lns_s * share >= forest_s * (1 - share)) and now + 1.5 * forest_s < deadline:
            lns_s = 0.0
            forests += 1
            forest_move(state, random_forest(core, rng, hubs_first=forests % 2 == 1))
            icm(state, deadline)
            bad, hot = _scan(state)
            if cfg.verbose:
                print(f"  forest {forests}: cost {state.total():.6g} peak {state.peak():.6g} bad {len(bad)} "
                      f"tries {tries} wins {wins} size {size}", flush=True)
            offer(state)
            last_offer = time.perf_counter()
            forest_s = last_offer - now
            if last_offer + overhead_s + 0.1 > deadline:
                break
        tries += 1
        if bad and rng.random() < 0.8:
            region = bfs_region(core, bad[rng.randrange(len(bad))], size, rng, adj=adj)
        elif hot and rng.random() < 0.4:  # around the edges that cost most now
            region = bfs_region(core, hot[rng.randrange(len(hot))], size, rng, adj=adj)
        elif mem_nodes and rng.random() < 0.5:
            region = time_region(state, alive_at, size, rng, adj=adj)
        else:
            region = bfs_region(core, rng.randrange(n), size, rng, adj=adj)
        begin = time.perf_counter()
        budget = min(cfg.region_time_s, deadline - begin - overhead_s - 0.1)
        if budget <= 0.05:
            break
        res = solve_region(state, region, budget, workers=cfg.workers, seed=rng.randrange(1 << 30),
                           deadline=begin + budget)
        if res.changed:
            wins += 1
            icm(state, deadline, nodes=region)
        overhead_s = max(0.8 * overhead_s, time.perf_counter() - begin - budget)
        lns_s += time.perf_counter() - begin
        if res.status == "OPTIMAL":
            size = min(int(size * 1.1) + 1, 20_000)
        else:
            size = max(200, int(size * 0.8))
        if time.perf_counter() - last_offer > 2.0:
            offer(state)
            last_offer = time.perf_counter()
    return {"lns_tries": tries, "lns_wins": wins, "forest_moves": forests, "region_vars": size}
