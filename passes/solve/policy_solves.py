"""Solving a lever graph once per combination of block-type policies, with the peak retries.

``solve_policies`` is the planner's inner loop (``planner._plan_within``, and the published layouts'
finalists through it): each combination's ILP is solved, and while its plan's peak exceeds the memory
limit, solved again under a lower ILP limit (``PeakRetry`` chooses it), keeping its LP between tries and
handing its LP solver to the next combination's ILP (its first LP then starts from that basis, not cold).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autoshard.passes.solve.ilp import ILPResult, solve
from autoshard.passes.solve.lever_graph import LeverGraph
from autoshard.passes.solve.strategy_graph import fix_policies
from autoshard.passes.solve.work_budget import WorkBudget

__all__ = ["PEAK_RETRIES", "solve_policies", "PeakRetry"]

#: how many times one combination is solved again under a lower limit before its answer stands
PEAK_RETRIES = 4


def solve_policies(graph: LeverGraph, combos: list[tuple], policies: dict[str, list[int]], budget: WorkBudget,
                    workers: int, cutoff, objective: str = "cost", tighten=None, cap=None,
                    carry: Optional[dict] = None):
    """Solve ``graph`` once per combination of block-type policies in ``combos`` (each a sorted
    tuple of (block type, policy index); answers mapped back to ``graph``'s strategy indices), or
    jointly when ``combos`` is ``[None]``. Yields (combination, ILPResult). ``cutoff()``: the
    per-microstep objective to beat, read before each solve. ``tighten(result)``: None when the
    answer stands, else a lower ILP memory limit for this combination, solved again (at most
    ``PEAK_RETRIES`` times; a limit the ILP finds nothing under is raised halfway back to the bytes of
    the last plan that did not fit; the last answer is yielded either way). ``cap``: ``ilp.solve``'s, on
    ``graph.graph``'s node and edge indices (which fixing the policies keeps).

    Each combination's ILP takes over the GLOP solver of the last combination's (``kept["donor"]`` of
    ``ilp.solve``, ``ShardingILP.adopt_lp``: as many variables and rows, the changed ones set in place),
    so its first LP restarts from that basis instead of cold. ``carry``: a dict a caller that solves
    ``graph``'s combinations one call at a time keeps between its calls, so that ILP passes from one call
    to the next (``carry["ilp"]``: the last ILP kept)."""
    groups = graph.graph.groups
    carry = {} if carry is None else carry
    for combo in combos:
        if combo is None or not groups:
            part, expand = replace(graph.graph), list
        else:
            chosen = dict(combo)
            part, expand = fix_policies(graph.graph, [policies[g.name].index(chosen[g.name]) for g in groups])
        # the ILP of ``part``, solved again under a lower limit by a retry; its LP solver the last one's
        kept: dict = {"donor": carry["ilp"]} if carry.get("ilp") is not None else {}
        retry = PeakRetry()
        for attempt in range(PEAK_RETRIES + 1):
            result = solve(part, objective=objective, time_limit_s=budget.next_limit(),
                           workers=workers, cutoff=cutoff() if objective == "cost" else None, kept=kept, cap=cap)
            budget.charge(result)
            if result.choice is not None:
                result.choice = expand(result.choice)
            if tighten is None:
                break
            lower = retry.next_limit(part.memory_limit, result, tighten, last=attempt == PEAK_RETRIES)
            if lower is None:
                break
            part.memory_limit = lower
        if "model" in kept:
            carry["ilp"] = kept["model"][2]
        yield combo, result


class PeakRetry:
    """The ILP limits one policy combination is solved under while its plans' peaks exceed the memory
    limit (``solve_policies``): ``tighten(result)`` proposes the next limit below a plan that does not
    fit, and a limit the ILP finds nothing under is raised halfway back to the bytes of the last plan
    that did not fit (a small model's ZeRO buckets and whole gradients, outside the ILP's bytes, put
    its first answers' peaks far above the limit, and their excess cut straight off left nothing)."""

    def __init__(self):
        self.below = 0.0  # the largest limit the ILP found nothing under
        self.over: Optional[float] = None  # the ILP bytes of the last plan whose peak did not fit

    def next_limit(self, limit: float, result: ILPResult, tighten, last: bool) -> Optional[float]:
        """The ILP limit to solve under next, after ``result`` under ``limit``; None: stop (the answer stands)."""
        if last:
            return None
        if result.choice is None:
            if self.over is None or result.status != "INFEASIBLE":
                return None
            self.below = limit  # tightened too far
            return (self.below + self.over) / 2
        lower = tighten(result)
        if lower is None:
            return None  # its peak fits
        self.over = result.memory
        return lower if lower > self.below else (self.below + self.over) / 2
