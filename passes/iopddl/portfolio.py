"""The search on a large core with toulbar2, on both cores (``solver`` runs it; see its docstring).

The main process solves the memory-free network once (its dual bound is the first lower bound, its
answer repaired the first toulbar2 start), then forks a worker (``parallel``) and runs
``pool_search``: adaptive penalties with toulbar2, chain moves, the pool and its recombination.
The worker runs, by ``SearchConfig.worker``:

* ``"bp"`` (default): the search without toulbar2 (belief propagation with per-time-point memory
  prices, then forest moves and CP-SAT neighbourhoods, ``lagrangian`` / ``lns``). The two
  searches fail differently (toulbar2 needs CPU seconds before its first answer on networks of
  millions of table entries; belief propagation stalls where chains must flip together), and
  whichever is ahead feeds the other through the shared incumbent;
* ``"wcsp"``: a second ``pool_search`` with another seed and penalty scale.

The Lagrangian bound (``penalties.lower_bound``) takes ``bound_share`` of the main process's time
first. Medium cores (``whole_max_vars``) end with CP-SAT on everything from the best answer.
"""
from __future__ import annotations

import random
import time

import numpy as np

from autoshard.passes.iopddl.lagrangian import MemoryIndex, lagrange_search, repair
from autoshard.passes.iopddl.lns import lns, memory_safe_start
from autoshard.passes.iopddl.local_search import State, icm
from autoshard.passes.iopddl.neighbourhood_search import region_size, solve_region
from autoshard.passes.iopddl.parallel import SharedBest, fork_worker, wait_worker
from autoshard.passes.iopddl.penalties import PenaltySearch, lower_bound
from autoshard.passes.iopddl.pool_search import pool_search
from autoshard.passes.iopddl.problem import FORBIDDEN
from autoshard.passes.iopddl.wcsp import WcspModel

__all__ = ["toulbar2_portfolio"]


def toulbar2_portfolio(core, deadline: float, timeout_s: float, cfg, offer, note_bound, stats) -> bool:
    """Run the search (see the module docstring) until ``deadline``: ``offer(state)`` each answer,
    ``note_bound(core_bound)`` each lower bound on the core total. False, having run nothing past
    the memory-free solve, when toulbar2 found no memory-free answer in time (tried twice, the
    second time with twice the CPU time): the caller then falls back."""
    t = time.perf_counter()
    # a quick memory-safe answer first: on a loaded machine toulbar2's CPU seconds stretch far
    offer(memory_safe_start(core, min(deadline, t + 0.03 * timeout_s)))
    model = WcspModel(core)
    free_s = min(8.0, max(3.0, 0.03 * timeout_s))
    free = model.solve(np.zeros(model.size), free_s, seed=cfg.seed + 1)
    note_bound(free.bound)
    if free.choice is None and deadline - time.perf_counter() > 8 * free_s:
        free_s *= 2
        free = model.solve(np.zeros(model.size), free_s, seed=cfg.seed + 2)
        note_bound(free.bound)
    stats["free_s"] = round(time.perf_counter() - t, 2)
    if free.choice is None:
        return False
    free_state = State(core, free.choice)
    state = State(core, free.choice)
    if repair(state, MemoryIndex(core), deadline):
        icm(state, deadline, nodes=state.improvable())
        offer(state)
    stats["mode"] = "wcsp"
    solve_s = cfg.solve_s or min(8.0, max(3.0, timeout_s / 30, free_s / 2))
    shared = SharedBest(core.n)
    if state.feasible() and state.total() < FORBIDDEN:
        shared.offer(state.total(), state.choice)
    seen = [shared.seq]

    def bring_in() -> None:  # the worker's best, verified and offered (the watchdog keeps it)
        if shared.seq != seen[0] and shared.total < np.inf:
            seq, total, choice = shared.read(timeout=1.0)
            seen[0] = seq
            if choice:
                offer(State(core, choice))

    def share_worker(st: State) -> None:
        if st.feasible() and st.total() < FORBIDDEN:
            shared.offer(st.total(), st.choice)

    def share_main(st: State) -> None:
        share_worker(st)
        offer(st)

    pid = None
    if cfg.processes > 1:
        end = deadline - 1.0
        pid = fork_worker(lambda: _worker(core, model, cfg, shared, share_worker, end, solve_s))
    bound_end = time.perf_counter() + cfg.bound_share * (deadline - time.perf_counter())
    note_bound(lower_bound(core, model, free_state, bound_end, time_limit_s=solve_s))
    # medium cores: the main process ends with CP-SAT on everything, from the best answer
    whole = region_size(core, list(range(core.n))) <= cfg.whole_max_vars
    now = time.perf_counter()
    end = deadline - max(1.0, 3.0 * stats.get("offer_s", 0.0))  # room for the last offers
    end = now + cfg.whole_after_wcsp * (end - now) if whole else end
    search = PenaltySearch(core, model, seed=cfg.seed)
    stats.update(pool_search(search, shared, share_main, end, seed=cfg.seed, penalty_share=cfg.penalty_share,
                             solve_s=solve_s, pool_size=cfg.pool_size, on_round=bring_in, verbose=cfg.verbose))
    bring_in()
    choice = shared.read(timeout=1.0)[2] if whole else []
    if choice:  # the cheapest answer of either process
        state = State(core, choice)
        left = deadline - 4.0 * stats.get("offer_s", 0.0) - time.perf_counter()
        res = solve_region(state, list(range(core.n)), max(0.05, 0.9 * left - 1.5), seed=cfg.seed,
                           deadline=time.perf_counter() + 0.9 * left - 1.5)
        stats["whole_status"] = res.status
        share_main(state)
        note_bound(res.bound)
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
        pool_search(search, shared, share, end, seed=cfg.seed + 7, penalty_share=cfg.penalty_share,
                    solve_s=solve_s, pool_size=cfg.pool_size)
        return
    now = time.perf_counter()
    state = lagrange_search(core, now + cfg.lagrange_share * (end - now), share, seed=cfg.seed + 7)
    if state is None:
        state = memory_safe_start(core, end)
    share(state)
    lns(state, lambda: end, cfg, random.Random(cfg.seed + 7), share)
    share(state)
