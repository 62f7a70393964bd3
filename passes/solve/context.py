"""One planning context: the settings every planner on the chain reads, resolved once.

``PlanContext.of`` is called once at the front door (``autoshard.driver``) and the context is handed
down the planner chain in place of loose hardware, memory limit, optimizer and
time limit keywords, so each setting has one default (here) and hardware is looked up once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.hardware_lookup import get_hardware

__all__ = ["PlanContext", "DEFAULT_OPTIMIZER", "DEFAULT_TIME_LIMIT_S"]

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
    def of(cls, hardware: Any, memory_limit: Optional[float] = None, optimizer: Optional[str] = None,
           time_limit_s: Optional[float] = None) -> "PlanContext":
        """The context for these settings, hardware looked up here once; None takes the default."""
        return cls(hardware, get_hardware(hardware), memory_limit,
                   DEFAULT_OPTIMIZER if optimizer is None else optimizer,
                   DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s)

    @property
    def memory_bytes(self) -> float:
        """The memory bound in bytes: ``memory_limit`` if given, else the device's memory."""
        return float(self.memory_limit) if self.memory_limit is not None else self.spec.memory_bytes
