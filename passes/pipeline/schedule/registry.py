"""Every pipeline schedule, described once: ``Schedule`` descriptors registered in ``SCHEDULES``.

A descriptor says everything the rest of the compiler asks about a schedule: how many stages each
rank owns (``virtual_stages``), where they sit (round robin, or a V: rank r owns stages r and
2p-1-r), whether it runs backward as separate input-grad (B) and weight-grad (W) passes, which
(p, m) it accepts (``problem``: None, or the reason and what to do instead), its compute order
(``order``, from ``orders.py``), the in-flight microbatches per stage in closed form (``held``, the
stage planner's quick estimate; the simulator's count is exact), whether ``pp="auto"`` tries it
(``searched``) and the ``family`` it is ranked with in the stage search (one shortlist per family). The generator (``generators.generate``), the stage planner (its pins, stage counts,
scoring) and ``Plan``'s check all read this table; none keeps its own list of names.

Adding a schedule: write its order in ``orders.py`` and its descriptor in ``_register`` below
(docs/extension.md). Interleaved 1F1B is a family: ``interleaved-1f1b`` is v = 2 (Megatron's common
setting, and the name saved plans use) and ``interleaved-1f1b-v<N>`` any v >= 2, made on first use.

>>> get_schedule("interleaved-1f1b-v3").virtual_stages, get_schedule("zbv").v_shape
(3, True)
>>> get_schedule("dualpipev").problem(4, 6)
'dualpipev needs at least 2 microbatches per rank pair: m=6 < 2*p=8; use m >= 8 or the zbv schedule'
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.orders import (dualpipev_order, gpipe_order, interleaved_order,
                                                       interleaved_rounds, one_f_one_b_order, zb_h1_order,
                                                       zbv_order)
from autoshard.passes.pipeline.schedule.simulate import ScheduleError

__all__ = ["Schedule", "SCHEDULES", "get_schedule", "schedule_names", "searched_schedules", "interleaved"]

Order = Callable[[int, int, int], dict[int, list[Action]]]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule (module docstring). ``valid`` is the only place its (p, m) rule lives."""
    name: str
    virtual_stages: int
    v_shape: bool
    split_backward: bool
    order: Order
    valid: Callable[[int, int], Optional[str]] = lambda p, m: None
    held: Optional[Callable[[int, int], list[int]]] = None
    searched: bool = False
    family: Optional[str] = None

    @property
    def ranking_family(self) -> str:
        """Schedules of one family (interleaved 1F1B's v's) share one closed form, so the stage search
        ranks them together and simulates one shortlist for all of them (bounding plan time)."""
        return self.family or self.name

    def problem(self, p: int, m: int) -> Optional[str]:
        """None when this schedule runs m microbatches on p rank groups, else why not and what to do."""
        return self.valid(p, m)

    def accepts(self, p: int, m: int) -> bool:
        return self.valid(p, m) is None

    def stage_rank(self, p: int) -> list[int]:
        """Rank owning each of the ``p * virtual_stages`` stages."""
        if self.v_shape:
            return list(range(p)) + list(range(p - 1, -1, -1))
        return [s % p for s in range(p * self.virtual_stages)]

    def approx_held(self, p: int, m: int) -> list[int]:
        """In-flight microbatches per stage in closed form (``held``), else 1F1B's p - rank."""
        if self.held is not None:
            return self.held(p, m)
        return [min(m, p - g) for g in self.stage_rank(p)]


def _dualpipev_valid(p: int, m: int) -> Optional[str]:
    if m < 2 * p:
        return (f"dualpipev needs at least 2 microbatches per rank pair: m={m} < 2*p={2 * p}; "
                f"use m >= {2 * p} or the zbv schedule")
    return None


def _interleaved_held(v: int) -> Callable[[int, int], list[int]]:
    def held(p: int, m: int) -> list[int]:
        # Megatron's warm-up 2 (p - g - 1) + (v - 1) * (first round), plus one, spread over the v stages
        g0 = len(interleaved_rounds(p, m)[0])
        return [math.ceil(min(m * v, 2 * (p - g - 1) + (v - 1) * g0 + 1) / v) for g in [s % p for s in range(p * v)]]
    return held


def _v_held(p: int, m: int) -> list[int]:
    return [min(m, 2 * p - s) for s in range(2 * p)]  # stage s of the V (2p stages) holds 2p - s


@functools.lru_cache(maxsize=None)
def interleaved(v: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``v`` >= 2 stages per rank; named ``interleaved-1f1b`` for
    v = 2, ``interleaved-1f1b-v<v>`` otherwise. Searched by ``pp="auto"`` for v <= ``SEARCHED_VIRTUAL_STAGES``."""
    if not isinstance(v, int) or v < 2:
        raise ScheduleError(f"interleaved 1F1B needs v >= 2 stages per rank, got {v!r}; "
                            f"for one stage per rank use '1f1b'")
    name = "interleaved-1f1b" if v == 2 else f"interleaved-1f1b-v{v}"
    return Schedule(name, v, v_shape=False, split_backward=False, order=interleaved_order, held=_interleaved_held(v),
                    searched=v <= SEARCHED_VIRTUAL_STAGES, family="interleaved-1f1b")


#: the most virtual stages per rank ``pp="auto"`` tries with interleaved 1F1B: every v from 2 up to this
#: one whose pp x v stages the model's units allow. 8 is the most a published run used (Llama 3 405B:
#: 126 layers plus the embedding and the head on pp 16 x v 8); fewer would leave such a layout out of
#: the search, so the planner could lose to it at equal memory
SEARCHED_VIRTUAL_STAGES = 8


def _register(*schedules: Schedule) -> dict[str, Schedule]:
    return {s.name: s for s in schedules}


#: the schedules with fixed names; ``get_schedule`` also makes ``interleaved-1f1b-v<N>`` on demand.
#: Not searched: GPipe (1F1B's time with more memory), DualPipeV (its F/B overlap is not modelled).
SCHEDULES: dict[str, Schedule] = _register(
    Schedule("gpipe", 1, v_shape=False, split_backward=False, order=gpipe_order, held=lambda p, m: [m] * p),
    Schedule("1f1b", 1, v_shape=False, split_backward=False, order=one_f_one_b_order, searched=True),
    interleaved(2),
    interleaved(3),
    *(interleaved(v) for v in range(4, SEARCHED_VIRTUAL_STAGES + 1)),
    Schedule("zb-h1", 1, v_shape=False, split_backward=True, order=zb_h1_order,
             held=lambda p, m: [min(m, p)] * p, searched=True),  # W is deferred: every stage holds p
    Schedule("zbv", 2, v_shape=True, split_backward=True, order=zbv_order, held=_v_held, searched=True),
    Schedule("dualpipev", 2, v_shape=True, split_backward=True, order=dualpipev_order, valid=_dualpipev_valid,
             held=_v_held),
)

_FAMILY = re.compile(r"interleaved-1f1b-v(\d+)")


def get_schedule(name: str) -> Schedule:
    """The descriptor named ``name``; ``ScheduleError`` naming the known ones otherwise."""
    if isinstance(name, str) and name in SCHEDULES:
        return SCHEDULES[name]
    match = _FAMILY.fullmatch(name) if isinstance(name, str) else None
    if match and int(match.group(1)) >= 2:
        return interleaved(int(match.group(1)))
    raise ScheduleError(f"unknown schedule {name!r}; schedules are {schedule_names()} "
                        f"(and interleaved-1f1b-v<N> for any N >= 2 stages per rank)")


def schedule_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(SCHEDULES)


def searched_schedules() -> tuple[str, ...]:
    """The schedules ``pp="auto"`` tries unless the user pins one."""
    return tuple(n for n, s in SCHEDULES.items() if s.searched)
