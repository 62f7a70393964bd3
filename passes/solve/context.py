"""One planning context: the settings every planner on the chain reads, resolved once.

``PlanContext.of`` is called once at the front door (``autoshard.driver``) and the context is handed
down the planner chain in place of loose hardware, memory limit, optimizer and
time limit keywords, so each setting has one default (here) and hardware is looked up once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.hardware_lookup import get_hardware

__all__ = ["PlanContext", "DEFAULT_HARDWARE", "DEFAULT_OPTIMIZER", "DEFAULT_TIME_LIMIT_S"]

#: the hardware a planner below the front door prices when it is handed no context (the front door
#: resolves "auto" to the local accelerator before it builds one: ``autoshard.driver.resolve_hardware``)
DEFAULT_HARDWARE = "h100"

#: the optimizer whose state the planners size when none is named
DEFAULT_OPTIMIZER = "adamw"
#: the CP-SAT budget of one intra-op solve when none is named
DEFAULT_TIME_LIMIT_S = 30.0


@dataclass(frozen=True)
class PlanContext:
    """What every planner reads. ``hardware``: the setting as given (a preset name, a profile path or a
    ``Hardware``), kept for the planners that still take it and for the plan's label; ``spec``: it
    resolved (``get_hardware``); ``memory_limit``: bytes per device, None for the device's own memory
    (``memory_bytes`` is the resolved figure); ``optimizer``; ``time_limit_s``: one intra-op solve's
    budget."""
    hardware: Any
    spec: Hardware
    memory_limit: Optional[float] = None
    optimizer: str = DEFAULT_OPTIMIZER
    time_limit_s: float = DEFAULT_TIME_LIMIT_S

    @classmethod
    def of(cls, hardware: Any = DEFAULT_HARDWARE, memory_limit: Optional[float] = None, optimizer: Optional[str] = None,
           time_limit_s: Optional[float] = None) -> "PlanContext":
        """The context for these settings, hardware looked up here once; None takes the default."""
        return cls(hardware, hardware if isinstance(hardware, Hardware) else get_hardware(hardware), memory_limit,
                   DEFAULT_OPTIMIZER if optimizer is None else optimizer,
                   DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s)

    @property
    def memory_bytes(self) -> float:
        """The memory bound in bytes: ``memory_limit`` if given, else the device's memory."""
        return float(self.memory_limit) if self.memory_limit is not None else self.spec.memory_bytes

    @classmethod
    def given(cls, ctx: Optional["PlanContext"]) -> "PlanContext":
        """``ctx``, or the default context (``DEFAULT_HARDWARE``, its memory, the default budget) for None."""
        return cls.of() if ctx is None else ctx

    def limited(self, memory_limit: Optional[float]) -> "PlanContext":
        """This context with another memory bound (a candidate's budget, a stage's re-plan limit)."""
        return replace(self, memory_limit=None if memory_limit is None else float(memory_limit))

    def timed(self, time_limit_s: float) -> "PlanContext":
        """This context with another solve budget (a pass of the candidate search, the stage ILP's rest)."""
        return replace(self, time_limit_s=float(time_limit_s))
