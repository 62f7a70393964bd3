"""The planner's shared work limit and the optimality gap it reports.

Solves are bounded by CP-SAT's deterministic work (``max_deterministic_time``), never by a clock, so
the same inputs give the same plan however busy the machine is. ``WorkBudget`` hands each solve what
is left of the planner's budget; ``solve_gap`` is one solve's relative distance from its proven bound.
"""
from __future__ import annotations

from typing import Optional

from autoshard.passes.solve.ilp import ILPResult

__all__ = ["WorkBudget", "solve_gap"]


class WorkBudget:
    """The solves' shared work limit, in CP-SAT deterministic seconds (never a clock)."""

    def __init__(self, total: float):
        self.total, self.spent = float(total), 0.0

    def next_limit(self, floor: float = 1.0) -> float:
        return max(floor, self.total - self.spent)

    def left(self) -> float:
        """Deterministic seconds not yet spent (negative once overdrawn)."""
        return self.total - self.spent

    def charge(self, result: ILPResult) -> None:
        self.spend(float(result.stats.get("work", 0.0)))

    def spend(self, work: float) -> None:
        """Charge ``work`` deterministic seconds (a solve that is not an ``ILPResult``)."""
        self.spent += float(work)


def solve_gap(result: ILPResult) -> Optional[float]:
    """(objective - proven lower bound) / objective of one solve; 0 when proven optimal, None without a bound."""
    if result.status == "OPTIMAL":
        return 0.0
    lower = result.stats.get("lower_bound")
    if lower is None or not result.cost:
        return None
    return round(max(0.0, (result.cost - lower) / result.cost), 6)
