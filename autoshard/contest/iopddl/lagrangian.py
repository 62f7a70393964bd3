"""Memory as a price (Lagrangian relaxation) on a presolved IOPDDL ``Core``.

The memory constraint ``load[t] <= limit`` is relaxed with a price ``lam[t] >= 0`` per time point:
node ``i`` then pays ``usage[i][s] * sum(lam[lo_i:hi_i])`` for strategy ``s``, which no longer
couples nodes through time, so the priced problem is a plain pairwise min-sum problem, solved by
belief propagation (``belief_propagation``) plus ICM. Each priced answer is made feasible by ``repair``
(cheapest memory per cost at the most loaded time point first), polished by memory-safe ICM and
offered. ``lagrange_search`` chooses the prices (see its docstring) and, through ``choose_mode``,
which strategies of hub nodes to clamp in the belief propagation.

>>> from autoshard.contest.iopddl.problem import Problem
>>> from autoshard.contest.iopddl.presolve import presolve
>>> from autoshard.contest.iopddl.local_search import State
>>> p = Problem([[0, 5], [0, 5]], [[4, 1], [4, 1]], [(0, 2), (1, 3)], [(0, 1)], [[0, 9, 9, 0]], 5)
>>> s = State(presolve(p, reduce=False), [0, 0])
>>> s.peak(), repair(s, MemoryIndex(s.core)), s.peak(), s.choice.tolist()   # one move suffices
(8.0, True, 5.0, [1, 0])
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN
from autoshard.contest.iopddl.belief_propagation import BeliefPropagation
from autoshard.contest.iopddl.local_search import State, icm

__all__ = ["LagrangeSettings", "MemoryIndex", "node_prices", "repair", "priced_core", "choose_mode", "lagrange_search"]


class MemoryIndex:
    """Which nodes' usage can change, and which of them are alive at a time point."""

    def __init__(self, core):
        self.core = core
        mem = [i for i in range(core.n) if core.lo[i] < core.hi[i] and np.ptp(core.usage[i]) > 0]
        self.nodes = np.array(mem, dtype=np.int64)
        self.lo = core.lo[self.nodes] if mem else np.zeros(0, dtype=np.int64)
        self.hi = core.hi[self.nodes] if mem else np.zeros(0, dtype=np.int64)

    def alive_at(self, t: int) -> list[int]:
        return self.nodes[(self.lo <= t) & (t < self.hi)].tolist()


def node_prices(core, lam: np.ndarray) -> np.ndarray:
    """``sum(lam[lo_i:hi_i])`` per node (0 for empty intervals), by prefix sums."""
    cum = np.concatenate([[0.0], np.cumsum(lam)])
    lo = np.minimum(core.lo, len(lam))
    hi = np.minimum(np.maximum(core.hi, core.lo), len(lam))
    return cum[hi] - cum[lo]


def repair(state: State, index: MemoryIndex, deadline: float = math.inf) -> bool:
    """Lower usage until the limit holds: at the most loaded time point, moves of nodes alive there
    to a smaller usage, cheapest added cost per unit of memory freed first (a move's cost counts its
    edges to the current neighbours). True when the state ends feasible."""
    core = state.core
    if core.limit is None:
        return True
    limit = core.limit
    stuck = 0
    while state.peak() > limit and time.perf_counter() < deadline:
        t = int(np.argmax(state.load))
        cands = []
        for i in index.alive_at(t):
            us = core.usage[i]
            cur = state.choice[i]
            lower = us < us[cur]
            if not lower.any():
                continue
            vec = state.local_costs(i)
            lower &= vec < FORBIDDEN  # never buy memory with a forbidden choice
            freed = us[cur] - us
            ratio = np.where(lower, (vec - vec[cur]) / np.maximum(freed, 1e-9), np.inf)
            s = int(np.argmin(ratio))
            if np.isfinite(ratio[s]):
                cands.append((ratio[s], i, s))
        if not cands:
            return False
        cands.sort()
        moved = False
        for _, i, s in cands:
            if state.load[t] <= limit:
                break
            us = core.usage[i]
            if us[s] < us[state.choice[i]]:
                state.move(i, s)
                moved = True
        if not moved:
            stuck += 1
            if stuck > 3:
                return False
    return state.peak() <= limit


def priced_core(core, price: np.ndarray):
    """The same core with ``price[i] * usage[i]`` added to node costs and no memory limit."""
    cost = [core.cost[i] + price[i] * core.usage[i] if price[i] else core.cost[i] for i in range(core.n)]
    return dataclasses.replace(core, cost=cost, limit=None)


@dataclasses.dataclass(frozen=True)
class LagrangeSettings:
    """The search's knobs (``lagrange_search`` says what each does)."""
    bp_iters: int = 8
    jump: float = 1e4
    grow: float = 100.0
    rounds: int = 400
    patience: int = 6
    shake: float = 0.5
    sweep_len: int = 10
    sweep_top: float = 1e3
    mode_share: float = 0.5
    mode_nodes: int = 12


def lagrange_search(core, deadline: float, offer: Callable[[State], None],
                    settings: LagrangeSettings = LagrangeSettings(), *, seed: int = 0,
                    verbose: bool = False) -> Optional[State]:
    """Price memory, solve the priced problem with belief propagation and priced ICM, repair and
    polish (memory-safe ICM), ``offer`` every feasible answer; returns the cheapest feasible state
    (``None`` when none was found before ``deadline``).

    Each time the bisection has settled, ``choose_mode`` (up to ``mode_share`` of the time left)
    clamps strategies of untried hubs (``mode_nodes`` in all) in the belief propagation, scoring
    each by its repaired answer at the fitting price; when that helped, the bisection starts again
    with the clamps kept.

    Prices: ``kappa`` per unit of memory and time point, on the time points any decoded answer
    overflowed so far (``hot``). With ``p0`` the free optimum's cost per memory-time, ``kappa``
    starts at ``jump * p0`` (high, so a first feasible answer comes early), grows by ``grow`` while
    decoded answers overflow, then is bisected (geometrically) between the largest overflowing price
    and the smallest fitting one (divided by ``grow`` while none overflowed). After
    ``patience`` rounds without a better feasible answer, sweeps of ``sweep_len`` rounds anneal the
    prices: messages forgotten, prices per time point shaken (log-normal, ``shake``) and lowered
    geometrically from ``sweep_top`` times the smallest fitting ``kappa`` to a little below it,
    until three sweeps bring nothing. Messages are kept between rounds: coming down from high
    prices keeps the decoded answers near feasibility (cold starts at the final price land in far
    worse fixed points).
    """
    bp_iters, jump, grow, rounds, patience = (settings.bp_iters, settings.jump, settings.grow, settings.rounds,
                                              settings.patience)
    shake, sweep_len, sweep_top = settings.shake, settings.sweep_len, settings.sweep_top
    mode_share, mode_nodes = settings.mode_share, settings.mode_nodes
    if core.n == 0:
        return None
    rng = np.random.default_rng(seed)
    index = MemoryIndex(core)
    bp = BeliefPropagation(core)
    free = State(priced_core(core, np.zeros(core.n)), bp.run(np.zeros(core.n), iters=2 * bp_iters,
                                                           deadline=deadline))
    icm(free, deadline, respect_memory=False, nodes=free.improvable())
    best: Optional[State] = None
    state = State(core, free.choice)
    if core.limit is None:
        offer(state)
        return state
    hot = state.load > core.limit
    if not hot.any():  # the free optimum fits
        icm(state, deadline, nodes=state.improvable())
        offer(state)
        return state
    length = np.maximum(core.hi - core.lo, 0)
    memtime = float(sum(core.usage[i][state.choice[i]] * length[i] for i in range(core.n)))
    p0 = max(state.total(), 1.0) / max(memtime, 1.0)
    kappa, low, high = p0 * jump, None, None
    lam = None  # per-time-point prices once bisection has settled
    stall = 0
    tried: set = set()  # nodes choose_mode has clamped

    def attempt(fit: float) -> Optional[State]:
        """Prices coming down to the fitting ``fit`` (warm messages); the answers at the last two
        prices repaired and polished; the cheaper feasible one (None when neither)."""
        found = None
        for f in (100.0, 10.0, 3.0, 1.0):
            price = node_prices(core, fit * f * hot)
            choice = bp.run(price, iters=bp_iters, deadline=deadline)
            if f > 3.0:
                continue
            ps = State(priced_core(core, price), choice)
            icm(ps, deadline, respect_memory=False, nodes=ps.improvable())
            st = State(core, ps.choice)
            if repair(st, index, deadline):
                icm(st, deadline, nodes=st.improvable())
                if st.feasible() and st.total() < FORBIDDEN and (found is None or st.total() < found.total()):
                    found = st
        return found

    for r in range(rounds):
        if time.perf_counter() > deadline:
            break
        if stall > (patience if lam is None else 3 * sweep_len):
            if lam is not None or high is None:
                break
            if len(tried) < mode_nodes:  # condition BP on hub strategies; bisect again if that helped
                now = time.perf_counter()
                fit_price = node_prices(core, high * hot)  # the scan's order: priced own cost
                found = choose_mode(bp, lambda: attempt(high), best.total() if best else math.inf,
                                    now + mode_share * (deadline - now), tried,
                                    max_nodes=mode_nodes - len(tried), verbose=verbose,
                                    rank=lambda h: core.cost[h] + fit_price[h] * core.usage[h])
                if found is not None:
                    best = State(core, found.choice.copy())
                    offer(best)
                    kappa, low, high, stall = p0 * jump, None, None, 0
                    continue
            lam, stall, sweep = hot.astype(np.float64), 0, 0
        stall += 1
        if lam is not None:  # anneal: cold start at high prices, then down to the fitting price
            step = sweep % sweep_len
            if step == 0:
                bp.reset()
                lam = hot * np.exp(rng.normal(0.0, shake, size=len(hot)))
            kappa = high * sweep_top ** (1.0 - step / (sweep_len - 2))
            sweep += 1
        price = node_prices(core, kappa * (hot if lam is None else lam))
        choice = bp.run(price, iters=bp_iters, deadline=deadline)
        ps = State(priced_core(core, price), choice)
        icm(ps, deadline, respect_memory=False, nodes=ps.improvable())
        state = State(core, ps.choice)
        over = state.peak() / core.limit
        if verbose:
            print(f"  lagrange {r}: {'kappa' if lam is None else 'anneal'} {kappa:.3g} priced cost "
                  f"{state.total():.6g} peak/limit {over:.3f}", flush=True)
        if lam is None:
            hot |= state.load > core.limit
            if over > 1.0:
                low = kappa
            else:
                high = kappa
            if high is None:
                kappa *= grow
            elif low is not None and high < 1.05 * low:
                stall = patience + 1  # bisection has converged: on to the sweeps
            else:
                kappa = math.sqrt(low * high) if low is not None else high / grow
        if repair(state, index, deadline):
            icm(state, deadline, nodes=state.improvable())
            if state.feasible() and state.total() < FORBIDDEN and (best is None or state.total() < best.total()):
                best = State(core, state.choice.copy())
                offer(best)
                stall = 0
    return best


def _distinct_strategies(core, i: int) -> list[int]:
    """Strategies of node ``i`` that differ in cost, usage or some edge row (twins give the same
    clamped answer)."""
    seen, out = set(), []
    for s in range(len(core.cost[i])):
        key = (core.cost[i][s], core.usage[i][s]) + tuple(m[s].tobytes() for _, m in core.nbrs[i])
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def choose_mode(bp: BeliefPropagation, attempt: Callable[[], Optional[State]], bound: float,
                deadline: float, tried: set, *, max_nodes: int = 12,
                rank: Optional[Callable[[int], np.ndarray]] = None, verbose: bool = False) -> Optional[State]:
    """Greedy conditioning of belief propagation on hub strategies: for the ``max_nodes`` nodes of
    highest degree not in ``tried`` (each is added), each other distinct strategy is clamped
    (``bp.clamp`` on top of the clamps kept so far, messages reset) and ``attempt()`` decodes a
    feasible state (or None); a clamp is kept when its state costs less than ``bound`` and every
    state found so far, and the scan stops after the first node that gave one. Loopy BP on graphs
    with hubs settles in one mode of many (on contest instance M, clamping one hub lowers the
    memory-free optimum found by a quarter). ``rank(h)`` (a score per strategy of ``h``) orders
    each node's scan, lowest first, so a scan cut short by ``deadline`` has tried the likeliest.
    Leaves ``bp`` with the clamps kept, messages reset; returns the best state (None when no clamp
    beat ``bound``)."""
    core = bp.core
    order = sorted((i for i in range(core.n) if len(core.cost[i]) > 1 and i not in tried),
                   key=lambda i: -len(core.nbrs[i]))
    best, clamps, best_cost = None, dict(bp.clamps), bound
    for h in order[:max_nodes]:
        if best is not None or time.perf_counter() > deadline:
            break
        tried.add(h)
        strategies = _distinct_strategies(core, h)
        if rank is not None:
            score = rank(h)
            strategies.sort(key=lambda s: score[s])
        for s in strategies:
            if time.perf_counter() > deadline:
                break
            if clamps.get(h) == s:
                continue
            bp.clamp({**clamps, h: s})
            bp.reset()
            st = attempt()
            cost = st.total() if st is not None else math.inf
            if verbose:
                print(f"  mode {h}={s}: cost {cost:.6g} (best {best_cost:.6g})", flush=True)
            if cost < best_cost:
                best, best_cost, clamps = st, cost, {**clamps, h: s}
    bp.clamp(clamps)
    bp.reset()
    return best
