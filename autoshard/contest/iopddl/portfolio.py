"""The search on a large core with toulbar2, on both cores (``solver`` runs it; see its docstring).

The main process solves the memory-free network once (its dual bound is the first lower bound, its
answer repaired the first toulbar2 start), then forks a worker (``parallel``) and runs
``pool_search``: adaptive penalties with toulbar2, chain moves, the pool and its recombination.
The worker runs, by ``SearchConfig.worker``:

* ``"bp"`` (default): first (``bp_share`` of its time) the search without toulbar2 (belief
  propagation with per-time-point memory prices, ``lagrangian``); then, if the shared best (from
  toulbar2) beats it, a second ``pool_search``, else forest moves and CP-SAT neighbourhoods from
  its own answer (``lns``). The two searches fail differently (toulbar2 needs CPU seconds before
  its first answer on networks of millions of table entries; belief propagation stalls where
  chains must flip together); the worker is forked before toulbar2's first solve, and if that
  finds nothing the main process only improves the shared pool;
* ``"wcsp"``: a second ``pool_search`` with another seed and penalty scale.

The Lagrangian bound (``penalties.lower_bound``) takes the last ``bound_share`` of the main
process's time. Medium cores (``whole_max_vars``) end with CP-SAT on everything from the best answer.
"""
from __future__ import annotations

import random
import time

import numpy as np

from autoshard.contest.iopddl.lagrangian import MemoryIndex, lagrange_search, repair
from autoshard.contest.iopddl.lns import lns, memory_safe_start
from autoshard.contest.iopddl.local_search import State, icm
from autoshard.contest.iopddl.neighbourhood_search import region_size, solve_region
from autoshard.contest.iopddl.parallel import SharedBest, fork_worker, wait_worker
from autoshard.contest.iopddl.penalties import PenaltySearch, lower_bound
from autoshard.contest.iopddl.pool_search import PoolSettings, pool_search
from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.wcsp import WcspModel

__all__ = ["toulbar2_portfolio"]


def toulbar2_portfolio(core, deadline: float, timeout_s: float, cfg, offer, note_bound, stats) -> bool:
    """Run the search (see the module docstring) until ``deadline``: ``offer(state)`` each answer,
    ``note_bound(core_bound)`` each lower bound on the core total. Without a worker
    (``cfg.processes == 1``): False, having run nothing past the memory-free solve, when toulbar2
    found no memory-free answer in time (tried twice, the second time with twice the CPU time);
    the caller then falls back."""
    t = time.perf_counter()
    # a quick memory-safe answer first: on a loaded machine toulbar2's CPU seconds stretch far
    quick = memory_safe_start(core, min(deadline, t + 0.03 * timeout_s))
    offer(quick)
    shared = SharedBest(core.n)
    seen = [shared.seq]
    model = WcspModel(core)
    # toulbar2's first answer on a network of millions of table entries (contest instance A) takes
    # ~9 CPU seconds of preprocessing and search; a shorter limit returns nothing
    free_s = min(12.0, max(4.0, 0.15 * timeout_s))
    solve_s = cfg.solve_s or min(8.0, max(3.0, timeout_s / 30, free_s / 2))

    def share_worker(st: State) -> None:
        """Either process: a new best of both goes to ``shared`` and, verified, to ``offer`` (so the
        caller's watchdog keeps it even while the main process is inside a long toulbar2 call).
        Two processes finding new bests within one verification of each other may leave the
        slightly worse one kept; the main process's final answer is the shared best either way."""
        if st.feasible() and st.total() < FORBIDDEN and shared.offer(st.total(), st.choice):
            offer(st)

    share_worker(quick)
    pid = None
    if cfg.processes > 1:  # forked first: it searches while toulbar2 finds its first answer
        end = deadline - 1.0
        pid = fork_worker(lambda: _worker(core, model, cfg, shared, share_worker, end, solve_s))
    cpu = time.process_time()
    free = model.solve(np.zeros(model.size), free_s, seed=cfg.seed + 1)
    note_bound(free.bound)
    if free.choice is not None and free.cost <= free.bound:
        # proved optimal before its limit: priced networks like it need about as long again
        solve_s = max(solve_s, 1.1 * (time.process_time() - cpu))
    if free.choice is None and deadline - time.perf_counter() > 4 * free_s:
        free_s *= 2
        free = model.solve(np.zeros(model.size), free_s, seed=cfg.seed + 2)
        note_bound(free.bound)
    stats["free_s"] = round(time.perf_counter() - t, 2)
    if free.choice is None and pid is None:
        return False
    stats["mode"] = "wcsp"
    if free.choice is not None:
        free_state = State(core, free.choice)
        state = State(core, free.choice)
        if repair(state, MemoryIndex(core), deadline):
            icm(state, deadline, nodes=state.improvable())
            offer(state)
            share_worker(state)

    def bring_in() -> None:  # the worker's best, verified and offered (the watchdog keeps it)
        if shared.seq != seen[0] and shared.total < np.inf:
            seq, total, choice = shared.read(timeout=1.0)
            seen[0] = seq
            if choice:
                offer(State(core, choice))

    def share_main(st: State) -> None:
        share_worker(st)
        offer(st)  # the main process's own record of its best (a no-op when not better)

    bring_in()
    whole = region_size(core, list(range(core.n))) <= cfg.whole_max_vars
    now = time.perf_counter()
    search_end = deadline - max(1.0, 3.0 * stats.get("offer_s", 0.0))  # room for the last offers
    # the Lagrangian bound comes last: the answers matter more, and bounds are kept as found
    bound_s = cfg.bound_share * (search_end - now) if free.choice is not None else 0.0
    search_end -= bound_s
    # medium cores: the main process ends with CP-SAT on everything, from the best answer
    end = now + cfg.whole_after_wcsp * (search_end - now) if whole else search_end
    search = PenaltySearch(core, model, seed=cfg.seed)
    # no memory-free answer: toulbar2 is too slow here, the main process only improves the pool
    share = cfg.penalty_share if free.choice is not None else 0.0
    stats.update(pool_search(search, shared, share_main, end, PoolSettings(seed=cfg.seed, penalty_share=share,
                             solve_s=solve_s, pool_size=cfg.pool_size), on_round=bring_in, verbose=cfg.verbose))
    bring_in()
    choice = shared.read(timeout=1.0)[2] if whole else []
    if choice:  # the cheapest answer of either process
        state = State(core, choice)
        left = search_end - time.perf_counter()
        res = solve_region(state, list(range(core.n)), max(0.05, 0.9 * left - 1.0), seed=cfg.seed,
                           deadline=time.perf_counter() + 0.9 * left - 1.0)
        stats["whole_status"] = res.status
        share_main(state)
        note_bound(res.bound)
    if free.choice is not None:
        def step(b: float) -> None:
            note_bound(b)
            bring_in()

        note_bound(lower_bound(core, model, free_state, search_end + bound_s, time_limit_s=solve_s, on_step=step))
    if pid is not None:
        wait_worker(pid, deadline)
    bring_in()
    stats["processes"] = cfg.processes
    stats["worker"] = cfg.worker if pid is not None else None
    return True


def _worker(core, model, cfg, shared: SharedBest, share, end: float, solve_s: float) -> None:
    """The forked process's search (``cfg.worker``), sharing through ``share``."""
    if cfg.worker == "wcsp":
        search = PenaltySearch(core, model, seed=cfg.seed + 7)
        search.w *= 0.1  # another starting scale than the main process's
        pool_search(search, shared, share, end, PoolSettings(seed=cfg.seed + 7, penalty_share=cfg.penalty_share,
                    solve_s=solve_s, pool_size=cfg.pool_size))
        return
    now = time.perf_counter()
    state = lagrange_search(core, now + cfg.bp_share * (end - now), share, seed=cfg.seed + 7)
    if state is None:
        state = memory_safe_start(core, end)
    share(state)
    if shared.total < (1.0 - 1e-3) * state.total():  # toulbar2 is ahead: help it instead
        search = PenaltySearch(core, model, seed=cfg.seed + 7)
        search.w *= 0.1
        pool_search(search, shared, share, end, PoolSettings(seed=cfg.seed + 7, penalty_share=cfg.penalty_share,
                    solve_s=solve_s, pool_size=cfg.pool_size))
        return
    lns(state, lambda: end, cfg, random.Random(cfg.seed + 7), share)
    share(state)
