"""Stage cuts without a solver: the balanced cut (the ILP's warm start and the stage search's first
price of every configuration), the even cut by unit count (Megatron's), and the least memory a cut
needs (what the infeasible message reports).
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Optional, Sequence

from autoshard.passes.pipeline.stages.stage_problem import (StageProblem, StageSolution, every_group_holds_params,
                                                            fits_memory, group_memory, priced_solution,
                                                            stage_memory_terms)

__all__ = ["balanced_starts", "balanced_stages", "even_stages", "leanest_memory"]


def balanced_starts(prob: StageProblem) -> Optional[list[int]]:
    """The first unit of every stage (``starts[0] == 0``) of the balanced cut: where the running work
    crosses multiples of total / S (the pinned boundaries if any); None with more stages than units."""
    L, S = len(prob.fwd), prob.num_stages
    if S > L:
        return None
    if prob.starts is not None:
        return [0] + list(prob.starts)
    run, prefix = 0.0, [0.0]
    for f, b in zip(prob.fwd, prob.bwd):
        run += f + b
        prefix.append(run)
    closest = _closest if all(f + b >= 0.0 for f, b in zip(prob.fwd, prob.bwd)) else _closest_by_scan
    starts = [0]
    for s in range(1, S):
        starts.append(closest(prefix, run * s / S, starts[-1] + 1, L - (S - s)))
    return starts


def _closest_by_scan(prefix: list[float], want: float, lo: int, hi: int) -> int:
    """The first i in lo..hi with the smallest |prefix[i] - want|."""
    return min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - want))


def _closest(prefix: list[float], want: float, lo: int, hi: int) -> int:
    """``_closest_by_scan`` for a non-decreasing ``prefix``, by bisection: the distance falls, then rises
    (float subtraction is monotone too), so the first closest index is the last one below ``want`` or
    the first at or above it, moved back over earlier indices exactly as far (a plateau). The same
    index as the scan, in O(log L) instead of O(L) per stage: the scan was ~40 % of the stage search's
    Python on Llama 3 405B (5.8 M distance evaluations over 678 configurations' balanced cuts)."""
    j = bisect_left(prefix, want, lo, hi + 1)  # the first index at or above want (hi + 1: none)
    if j > lo and (j > hi or abs(prefix[j - 1] - want) <= abs(prefix[j] - want)):
        best = j - 1
        gap = abs(prefix[best] - want)
        while best > lo and abs(prefix[best - 1] - want) == gap:
            best -= 1
        return best
    return j


def leanest_memory(prob: StageProblem, starts: Sequence[int]) -> float:
    """The busiest rank group's memory (``group_memory``, what constraint (3) / (3') compares with the
    limit) of the cut ``starts`` when every stage recomputes or not, whichever makes its in-step peak
    smaller (as pinned, if ``prob.recompute`` is): the least this cut needs per device."""
    ends = list(starts[1:]) + [len(prob.fwd)]
    in_step: dict[int, float] = {}
    optimizer: dict[int, float] = {}
    for s, (a, b) in enumerate(zip(starts, ends)):
        g = prob.stage_group[s]
        options = (False, True) if prob.recompute is None else (bool(prob.recompute),)
        terms = [stage_memory_terms(prob, a, b, r, s) for r in options]
        in_step[g] = in_step.get(g, 0.0) + min(x for x, _ in terms)
        optimizer[g] = optimizer.get(g, 0.0) + terms[0][1]
    return max(max(in_step[g], optimizer[g]) for g in in_step)


def balanced_stages(prob: StageProblem) -> Optional[StageSolution]:
    """A fast heuristic answer (the ILP's warm start): cut where the running work crosses multiples of
    total / S, then recompute on every stage that would not fit otherwise. None if that does not fit."""
    t0 = time.perf_counter()
    S = prob.num_stages
    starts = balanced_starts(prob)
    if starts is None:
        return None
    recompute = [bool(prob.recompute)] * S if prob.recompute is not None else [False] * S
    if prob.recompute is None:
        per = group_memory(prob, starts, recompute)
        recompute = [per[prob.stage_group[s]] > prob.memory_limit for s in range(S)]
    sol = priced_solution(prob, starts, recompute, "HEURISTIC", time.perf_counter() - t0)
    return sol if fits_memory(prob, sol) and every_group_holds_params(prob, starts) else None


def even_stages(prob: StageProblem, recompute: bool, check_memory: bool = True) -> Optional[StageSolution]:
    """The textbook cut: stage s starts at unit round(s L / S) (Megatron's even split by layer count;
    with the embedding and the head as units of their own, Megatron-Core's split that counts them as
    layers), with recompute on every stage or none. None if it does not fit (``check_memory`` False:
    whatever its memory)."""
    L, S = len(prob.fwd), prob.num_stages
    if S > L or prob.starts is not None:
        return None
    starts = [round(s * L / S) for s in range(S)]
    sol = priced_solution(prob, starts, [recompute] * S, "EVEN", 0.0)
    fits = not check_memory or fits_memory(prob, sol)
    return sol if fits and every_group_holds_params(prob, starts) else None
