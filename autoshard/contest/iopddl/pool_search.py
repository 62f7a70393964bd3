"""The search each process runs on a large core (``solver`` forks one per core):

1. **penalty phase** (``penalty_share`` of the time): ``PenaltySearch.step`` solves the priced
   network with toulbar2, repairs and polishes the answer; chain moves (``chain_moves``) then
   improve it, and it joins the ``Pool``;
2. **improvement phase**: rounds of recombination (two pool members' disagreement re-solved
   with CP-SAT), CP-SAT neighbourhoods around the incumbent (costly edges, busy time points,
   random nodes), exact forest moves and chain moves; the shared incumbent (``SharedBest``) is
   adopted whenever another process has a cheaper one.

Every answer that improves this process's best is handed to ``share(state)``.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from autoshard.contest.iopddl.chain_moves import ChainSearch
from autoshard.contest.iopddl.forest_moves import forest_move, random_forest
from autoshard.contest.iopddl.local_search import State, icm
from autoshard.contest.iopddl.neighbourhood_search import solve_region
from autoshard.contest.iopddl.parallel import SharedBest
from autoshard.contest.iopddl.penalties import PenaltySearch
from autoshard.contest.iopddl.pool import Pool, recombine
from autoshard.contest.iopddl.regions import adjacency, bfs_region, time_region

__all__ = ["PoolSettings", "pool_search"]


@dataclass(frozen=True)
class PoolSettings:
    """The search's knobs: ``seed``; ``penalty_share`` of the time in the penalty phase; ``solve_s`` per
    toulbar2 solve (doubled while it finds nothing); ``pool_size`` answers kept; ``region_vars`` and
    ``region_s`` of a CP-SAT neighbourhood; ``chain_s`` per chain-move run."""
    seed: int = 0
    penalty_share: float = 0.6
    solve_s: float = 4.0
    pool_size: int = 8
    region_vars: int = 4000
    region_s: float = 1.0
    chain_s: float = 0.5


def pool_search(search: PenaltySearch, shared: SharedBest, share: Callable[[State], None], deadline: float,
                settings: PoolSettings = PoolSettings(), *, on_round: Optional[Callable[[], None]] = None,
                verbose: bool = False) -> dict:
    """Run both phases until ``deadline`` (``time.perf_counter``); returns statistics.
    ``on_round()`` is called between steps (the main process brings in the shared best there)."""
    seed, penalty_share, solve_s, pool_size = settings.seed, settings.penalty_share, settings.solve_s, settings.pool_size
    region_vars, region_s, chain_s = settings.region_vars, settings.region_s, settings.chain_s
    core = search.core
    rng = random.Random(seed)
    pool = Pool(pool_size)
    stats = {"penalty_steps": 0, "penalty_answers": 0, "recombinations": 0, "recombination_wins": 0,
             "lns_wins": 0, "chains": 0}
    start = time.perf_counter()
    penalty_end = start + penalty_share * (deadline - start)

    def consider(state: State) -> None:
        total = state.total()
        if pool.add(total, state.choice):
            share(state)

    while time.perf_counter() + 1.5 * solve_s < penalty_end:
        if on_round:
            on_round()
        stats["penalty_steps"] += 1
        state = search.step(deadline, solve_s)
        if state is None:  # perhaps toulbar2 had too little time to find anything: give it more
            solve_s = min(2.0 * solve_s, max(1.0, (penalty_end - time.perf_counter()) / 3))
            continue
        stats["penalty_answers"] += 1
        kept, _ = ChainSearch(state).run(min(deadline, time.perf_counter() + chain_s), rng)
        stats["chains"] += kept
        consider(state)
        if verbose:
            print(f"  penalty {stats['penalty_steps']}: {state.total():.6g} (pool best "
                  f"{pool.best()[0]:.6g})", flush=True)

    adj = adjacency(core)
    mem_index = search.index
    seen_seq = -1
    size = region_vars
    while time.perf_counter() + region_s + 0.2 < deadline:
        if on_round:
            on_round()
        if shared.seq != seen_seq:  # another process found something: bring it into the pool
            seen_seq, total, choice = shared.read()
            if total < np.inf:
                pool.add(total, choice)
        best = pool.best()
        if best is None:
            break
        state = State(core, best[1])
        parents = pool.pair(rng)
        if parents is not None and rng.random() < 0.4:
            stats["recombinations"] += 1
            child = recombine(core, parents[0], parents[1], region_s, rng, max_vars=size,
                              deadline=deadline - 0.1, adj=adj)
            if child is not None:
                stats["recombination_wins"] += 1
                icm(child, deadline, nodes=child.improvable())
                consider(child)
            continue
        r = rng.random()
        if r < 0.35:
            region = time_region(state, mem_index.alive_at, size, rng, adj=adj)
        elif r < 0.7:
            region = bfs_region(core, _costly_node(state, rng), size, rng, adj=adj)
        else:
            region = bfs_region(core, rng.randrange(core.n), size, rng, adj=adj)
        res = solve_region(state, region, region_s, seed=rng.randrange(1 << 30), deadline=deadline - 0.1)
        size = min(int(size * 1.1) + 1, 20_000) if res.status == "OPTIMAL" else max(300, int(size * 0.8))
        if rng.random() < 0.2 and time.perf_counter() + 2.0 < deadline:
            forest_move(state, random_forest(core, rng, hubs_first=rng.random() < 0.5))
            icm(state, deadline)
        if res.changed:
            stats["lns_wins"] += 1
            icm(state, deadline, nodes=region)
            kept, _ = ChainSearch(state).run(min(deadline - 0.1, time.perf_counter() + chain_s), rng,
                                             nodes=region)
            stats["chains"] += kept
        if state.feasible() and state.total() < best[0]:
            consider(state)
    stats["penalty_s"] = round(penalty_end - start, 1)
    stats["pool"] = [round(t) for t, _ in pool.items[:3]]
    return stats


def _costly_node(state: State, rng: random.Random, sample: int = 256) -> int:
    """A node drawn among ``sample`` random ones with probability growing with its local cost
    now (node cost plus incident edges)."""
    core = state.core
    cand = [rng.randrange(core.n) for _ in range(sample)]
    costs = np.array([state.local_costs(i)[state.choice[i]] for i in cand])
    costs = np.maximum(costs - costs.min(), 0.0) + 1e-9
    p = costs / costs.sum()
    return cand[int(np.searchsorted(np.cumsum(p), rng.random()))]
