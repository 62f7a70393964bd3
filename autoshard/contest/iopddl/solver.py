"""The IOPDDL solver. Presolve (``presolve``), then by the size of the reduced core:

* small (``exact_max_vars``): one exact CP-SAT model of everything, so small instances end optimal
  (CP-SAT's bound is the lower bound);
* otherwise, with toulbar2 installed (``wcsp``), ``portfolio``: the memory-free network solved
  once (its dual bound the first lower bound, its answer repaired the first toulbar2 start), the
  Lagrangian bound, then on both cores (``parallel``: the process forks after presolve, the two
  share their best) ``pool_search`` (adaptive memory penalties with toulbar2 (``penalties``) and
  chain moves (``chain_moves``) fill a pool of answers; recombination (``pool``), CP-SAT
  neighbourhoods (``neighbourhood_search``, shaped by ``regions``), forest moves and chain moves
  improve it) beside the search without toulbar2 in the worker;
* without toulbar2, the older path: memory priced per time point with belief propagation
  (``lagrangian``), or a memory-safe greedy start, then forest moves alternating with CP-SAT
  neighbourhoods; medium cores (``whole_max_vars``) end with CP-SAT on everything.

Only answers that pass ``problem.verify`` (memory limit kept, nothing forbidden) are ever returned.
``SolveResult.lower_bound`` says how far from optimal the answer can be (``None``: not computed).

``autoshard solve`` and ``benchmarks/iopddl.py`` run it on contest files. The sharding planner does
not: it solves its own problems with the ILP of ``passes/solve/ilp.py``. A planner problem can
still be handed to this solver through ``problem.from_strategy_graph``.

>>> from autoshard.contest.iopddl.problem import Problem
>>> p = Problem([[1, 5], [2, 0]], [[3, 1], [2, 2]], [(0, 2), (1, 3)], [(0, 1)], [[0, 4, 4, 0]], 4)
>>> r = solve_problem(p, timeout_s=5)
>>> r.choice, r.cost, r.lower_bound
([1, 1], 5, 5)
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN, Problem, verify
from autoshard.contest.iopddl.local_search import State
from autoshard.contest.iopddl.lagrangian import lagrange_search
from autoshard.contest.iopddl.lns import lns, memory_safe_start
from autoshard.contest.iopddl.neighbourhood_search import region_size, solve_region
from autoshard.contest.iopddl.portfolio import toulbar2_portfolio
from autoshard.contest.iopddl.presolve import presolve
from autoshard.contest.iopddl.wcsp import available as wcsp_available

__all__ = ["SolveResult", "SearchConfig", "solve_problem"]


@dataclass
class SearchConfig:
    """Knobs of the search (defaults tuned on the contest instances)."""
    exact_max_vars: int = 40_000     # cores up to this many CP-SAT variables are solved whole
    whole_max_vars: int = 200_000    # up to this size, CP-SAT finishes on the whole core
    whole_after: float = 0.35        # ... after this share of the search time
    region_vars: int = 2_500         # starting neighbourhood size, in CP-SAT variables
    region_time_s: float = 1.0       # CP-SAT time per neighbourhood
    workers: int = 1
    forest_share: float = 0.5        # share of search time spent on forest moves (+ ICM)
    forest_share_bad: float = 0.8    # the same while forbidden costs remain
    seed: int = 0
    verbose: bool = False
    lagrange_share: float = 0.7      # of the time left after presolve: priced belief propagation
    presolve_share: float = 0.4      # presolve stops (still exact) at this share of the timeout
    margin_s: float = 1.0            # kept back (plus 1% of the timeout) to verify and print the answer
    use_wcsp: bool = True            # toulbar2 penalty search when pytoulbar2 is installed
    processes: int = 2               # searches on large cores (forked after presolve)
    penalty_share: float = 0.75      # of the search time: penalty solves, then improvement
    solve_s: Optional[float] = None  # toulbar2 CPU seconds per penalty solve (None: timeout / 30, 3..8)
    pool_size: int = 8
    whole_after_wcsp: float = 0.6    # medium cores: share of the search before CP-SAT on everything
    bound_share: float = 0.1         # of the search time: Lagrangian bound (main process, first)
    worker: str = "bp"               # the forked process's search: "bp" or "wcsp" (``portfolio``)
    bp_share: float = 0.3            # the "bp" worker's belief-propagation phase, of its time


@dataclass
class SolveResult:
    choice: list[int]                # [] when no feasible answer was found
    cost: Optional[int]
    status: str                      # OPTIMAL, FEASIBLE, INFEASIBLE or NONE
    stats: dict = field(default_factory=dict)
    lower_bound: Optional[int] = None  # no answer costs less (None: no bound was computed)


def solve_problem(problem: Problem, timeout_s: float, *, start: Optional[float] = None,
                  config: Optional[SearchConfig] = None,
                  on_progress: Optional[Callable[[float, int], None]] = None,
                  on_answer: Optional[Callable[[list, int], None]] = None,
                  on_bound: Optional[Callable[[int], None]] = None) -> SolveResult:
    """Best answer found before ``start + timeout_s`` (``start`` defaults to now, as
    ``time.perf_counter``). ``on_progress(elapsed_s, cost)`` and ``on_answer(choice, cost)`` are
    called on each verified improvement (a caller that must answer by a deadline keeps the latest),
    ``on_bound(lower_bound)`` on each better lower bound known during the search."""
    cfg = config or SearchConfig()
    t0 = time.perf_counter() if start is None else start
    deadline = t0 + timeout_s - cfg.margin_s - 0.01 * timeout_s
    rng = random.Random(cfg.seed)
    core = presolve(problem, deadline=t0 + cfg.presolve_share * timeout_s)
    stats = {"core_nodes": core.n, "presolve_s": round(time.perf_counter() - t0, 2)}
    best: list = [None, None, None]  # (choice, cost, the state's core total)
    offset: list = [None]  # real cost minus core total (a constant), known from the first answer
    bound: list = [-math.inf]  # the best lower bound on the core total

    def note_bound(core_bound: float) -> None:
        if core_bound > bound[0]:
            bound[0] = core_bound
            if on_bound and offset[0] is not None:
                on_bound(_real_bound(bound[0], offset[0], best[1]))

    def offer(state: State) -> None:
        total = state.total()
        if not state.feasible() or total >= FORBIDDEN or (best[2] is not None and total >= best[2]):
            return  # the core total differs from the real cost by a constant: no better answer
        best[2] = total
        t = time.perf_counter()
        choice = core.expand(state.choice)
        v = verify(problem, choice)
        stats["offer_s"] = max(stats.get("offer_s", 0.0), time.perf_counter() - t)
        if offset[0] is None:
            offset[0] = v.cost - total
            if on_bound and np.isfinite(bound[0]):
                on_bound(_real_bound(bound[0], offset[0], v.cost))
        if v.feasible and (best[1] is None or v.cost < best[1]):
            best[0], best[1] = choice, v.cost
            if on_answer:
                on_answer(choice, v.cost)
            if on_progress:
                on_progress(time.perf_counter() - t0, v.cost)

    everything = list(range(core.n))
    if region_size(core, everything) <= cfg.exact_max_vars:
        state = memory_safe_start(core, deadline)
        offer(state)
        res = solve_region(state, everything, max(0.05, deadline - time.perf_counter()),
                           workers=max(cfg.workers, 2), keep_current=False, seed=cfg.seed)
        offer(state)
        stats["mode"] = "exact"
        status = res.status if best[0] is not None or res.status == "INFEASIBLE" else "NONE"
        if best[0] is None:
            return SolveResult([], None, "INFEASIBLE" if res.status == "INFEASIBLE" else "NONE", stats)
        note_bound(res.bound)
        return SolveResult(best[0], best[1], status if status == "OPTIMAL" else "FEASIBLE", stats,
                           _real_bound(bound[0], offset[0], best[1]))

    if cfg.use_wcsp and wcsp_available():
        if toulbar2_portfolio(core, deadline, timeout_s, cfg, offer, note_bound, stats):
            if best[0] is None:
                return SolveResult([], None, "NONE", stats)
            return SolveResult(best[0], best[1], "FEASIBLE", stats, _real_bound(bound[0], offset[0], best[1]))

    now = time.perf_counter()
    state = lagrange_search(core, now + cfg.lagrange_share * (deadline - now), offer, verbose=cfg.verbose)
    stats["lagrange_s"] = round(time.perf_counter() - now, 2)
    if state is None:  # no priced answer could be repaired in time: the memory-safe local start
        state = memory_safe_start(core, deadline)
        stats["start"] = "greedy"
    offer(state)
    stats["mode"] = "lns"
    whole = region_size(core, everything) <= cfg.whole_max_vars
    now = time.perf_counter()
    # medium cores: after a local-search phase, CP-SAT on everything from the best state found
    lns_end = now + cfg.whole_after * (deadline - now) if whole else deadline
    # room for the last offer, the caller's own check of the answer and a loaded machine
    stats.update(lns(state, lambda: min(lns_end, deadline - 4.0 * stats.get("offer_s", 0.0)), cfg, rng, offer))
    offer(state)
    if whole and state.feasible() and state.total() < FORBIDDEN:
        stats["mode"] = "lns+whole"
        left = deadline - 4.0 * stats.get("offer_s", 0.0) - time.perf_counter()
        # CP-SAT can run past its limit by a second or more on a busy machine
        res = solve_region(state, everything, max(0.05, 0.9 * left - 1.5), workers=max(cfg.workers, 2),
                           seed=cfg.seed, deadline=time.perf_counter() + 0.9 * left - 1.5)
        stats["whole_status"] = res.status
        offer(state)
    if best[0] is None:
        return SolveResult([], None, "NONE", stats)
    return SolveResult(best[0], best[1], "FEASIBLE", stats, _real_bound(bound[0], offset[0], best[1]))


def _real_bound(core_bound: float, offset: Optional[float], cost: Optional[int]) -> Optional[int]:
    """A core bound as a bound on the real cost (costs are integers: rounded up, less a hair for
    floating point), never above the answer's cost."""
    if offset is None or not np.isfinite(core_bound):
        return None
    b = core_bound + offset
    lb = math.ceil(b - 1e-9 * abs(b) - 1e-6)
    return lb if cost is None else min(lb, cost)
