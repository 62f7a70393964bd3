"""The checks a schedule passes before a rank runs it: deadlock-free as executed, and consistent
with the plan it runs (microbatches, and which rank group runs which stage)."""
from __future__ import annotations

from typing import Any

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.pipeline.schedule.simulate import check_deadlock

from .interpreter import executed_schedule

__all__ = ["check_schedule"]


def check_schedule(plan: Any, schedule: dict) -> None:
    """Raise (``check_deadlock``'s error, or ``PlanFormatError`` naming the mismatch) unless
    ``schedule`` (rank group -> actions) is deadlock-free as the interpreter executes it, runs exactly
    microbatches 0..plan.microbatches-1, and runs every compute action on its stage's rank group."""
    check_deadlock(executed_schedule(schedule), require_comms=False)
    mbs = sorted({a.microbatch for acts in schedule.values() for a in acts})
    if mbs != list(range(plan.microbatches)):
        raise PlanFormatError(f"the schedule runs microbatches {mbs[:3]}..{mbs[-1:]} but the plan cuts the batch "
                              f"into {plan.microbatches}; generate the schedule with m={plan.microbatches}")
    for group, acts in schedule.items():
        for a in acts:
            if a.kind in ("F", "B", "W", "BW") and plan.stages[a.stage].group != group:
                raise PlanFormatError(f"schedule runs {a} on rank group {group} but the plan puts stage "
                                      f"{a.stage} on group {plan.stages[a.stage].group}")
