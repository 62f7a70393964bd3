"""``PlanOptions``: every keyword ``plan`` and ``compile`` share, in one frozen dataclass, checked once.

>>> PlanOptions.of(hardware="cpu", accumulation=2).levers
{'accumulation': 2}

``PlanOptions.of(**keywords)`` builds it from the keywords of ``autoshard.plan``/``compile`` (unknown
keywords are a ``TypeError`` naming them) and checks every value once, before anything is traced:
``pp``, the pipeline keywords, the memory levers (their keywords and checks come from the lever table,
``passes.levers.LEVERS``) and the pins. ``check_entry(entry, ...)`` then refuses the combinations one
entry path cannot honour (a pin with a saved pipelined plan, ...); every memory lever goes with
``pp=``. The driver (``autoshard.driver``) reads the options and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from autoshard.passes.levers import check_lever, lever_keywords
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.context import DEFAULT_OPTIMIZER, DEFAULT_TIME_LIMIT_S
from autoshard.layout_plans import check_layout_arguments
from autoshard.runtime.compile_backend import CompileOptions

__all__ = ["PlanOptions", "PIN_KEYWORDS", "ENTRIES"]

#: the pin keywords of ``plan``/``compile`` (``passes.sharding.pins.Pins``' fields)
PIN_KEYWORDS = ("params", "inputs", "ops", "strategies")
#: the entry paths of the driver, as ``check_entry`` names them
ENTRIES = ("plan", "compile", "plan-captured")


def pipeline_requested(pp) -> bool:
    """Whether ``pp`` asks for pipeline planning: "auto" or an int > 1 (None and 1: no pipeline).
    ValueError for anything else."""
    if pp is None:
        return False
    if isinstance(pp, str):
        if pp != "auto":
            raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
        return True
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
    return pp > 1


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (see ``autoshard.plan`` for each keyword's meaning). Values as the user gave them;
    ``levers`` and ``pins`` hold only the keywords given (lever keyword -> value; pin keyword -> dict).
    A new option is one field here (and its check in ``__post_init__``)."""
    hardware: Any = "auto"
    memory_limit: Optional[int] = None
    optimizer: str = DEFAULT_OPTIMIZER
    random_seed: Optional[int] = None
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    pp: Union[None, int, str] = None
    schedule: Optional[str] = None
    microbatches: Optional[int] = None
    stages: Optional[tuple] = None
    expert_load: Any = None
    #: ``autoshard.layouts.Layout``: price exactly that layout (``autoshard.layout_plans``), no search
    layout: Any = None
    #: ``compile`` only: run each rank's program through ``torch.compile`` (True, or a
    #: ``runtime.compile_backend.CompileOptions``); planning does not depend on it
    compile: Any = False
    levers: Mapping[str, Any] = field(default_factory=dict)
    pins: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, **keywords) -> "PlanOptions":
        """The options from ``plan``/``compile`` keywords: lever keywords (``passes.levers.LEVER_KEYWORDS``)
        go to ``levers``, pin keywords (``PIN_KEYWORDS``) to ``pins``; any other unknown keyword is a
        TypeError naming it."""
        known_levers = lever_keywords()  # the table as it stands now
        levers = {k: keywords.pop(k) for k in known_levers if keywords.get(k) is not None}
        for k in known_levers:
            keywords.pop(k, None)
        pins = {k: keywords.pop(k) for k in PIN_KEYWORDS if keywords.get(k)}
        for k in PIN_KEYWORDS:
            keywords.pop(k, None)
        known = {f for f in cls.__dataclass_fields__ if f not in ("levers", "pins")}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise TypeError(f"unknown keyword(s) {unknown}; pins are {list(PIN_KEYWORDS)}, memory levers are "
                            f"{list(known_levers)}, the other options are {sorted(known)}")
        if keywords.get("stages") is not None:
            keywords["stages"] = tuple(keywords["stages"])
        return cls(levers=levers, pins=pins, **keywords)

    def __post_init__(self):
        pipeline_requested(self.pp)
        if self.microbatches is not None and (isinstance(self.microbatches, bool)
                                              or not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise TypeError(f"microbatches={self.microbatches!r}: pass an int >= 1 (or leave it to the planner)")
        if self.random_seed is not None and (isinstance(self.random_seed, bool) or not isinstance(self.random_seed, int)):
            raise TypeError(f"random_seed={self.random_seed!r}: pass an int (or None to solve)")
        if isinstance(self.time_limit_s, bool) or not isinstance(self.time_limit_s, (int, float)) \
                or self.time_limit_s <= 0:
            raise TypeError(f"time_limit_s={self.time_limit_s!r}: pass a number of seconds > 0")
        CompileOptions.of(self.compile)  # a TypeError naming what to pass
        if not isinstance(self.optimizer, str):
            raise TypeError(f"optimizer={self.optimizer!r}: pass the optimizer's name (e.g. 'adamw', 'sgd')")
        unknown = sorted(set(self.levers) - set(lever_keywords()))
        if unknown:
            raise TypeError(f"unknown lever(s) {unknown}; levers are {list(lever_keywords())}")
        for keyword, value in self.levers.items():
            check_lever(keyword, value)
        unknown = sorted(set(self.pins) - set(PIN_KEYWORDS))
        if unknown:
            raise TypeError(f"unknown keyword(s) {unknown}; pins are {list(PIN_KEYWORDS)}")

    # ---- what the driver reads ---------------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """Whether the stage planner runs (``pp="auto"`` or an int > 1)."""
        return pipeline_requested(self.pp)

    @property
    def compile_options(self) -> Optional[CompileOptions]:
        """``compile=`` as ``CompileOptions`` (None: the program runs eagerly)."""
        return CompileOptions.of(self.compile)

    @property
    def pp_pin(self) -> Optional[int]:
        """``pp`` as the stage planner takes it: None to choose, else the pinned count."""
        return None if self.pp in (None, "auto") else int(self.pp)

    def lever_pins(self, **overrides) -> LeverPins:
        """The given levers (with ``overrides`` on top) as the planner's ``LeverPins``."""
        return LeverPins(**{**self.levers, **overrides})

    def pin_object(self, **only) -> Optional[Pins]:
        """The pins as ``Pins`` (None when none is given); ``only`` replaces them."""
        given = {k: v for k, v in (only or self.pins).items() if v}
        return Pins(**given) if given else None

    def with_levers(self, **levers) -> "PlanOptions":
        """These options with ``levers`` pinned on top (a value None drops that pin)."""
        merged = {k: v for k, v in {**self.levers, **levers}.items() if v is not None}
        return PlanOptions(**{f: getattr(self, f) for f in self.__dataclass_fields__ if f != "levers"}, levers=merged)

    # ---- what each entry path refuses ---------------------------------------------------------------
    def check_entry(self, entry: str, saved: Any = None) -> None:
        """Refuse what ``entry`` (one of ``ENTRIES``) cannot honour, with a TypeError naming the keywords:
        a pipeline takes every memory lever but no random seed or pin but ``params=`` (``compile``;
        ``plan`` with ``pp=`` takes no pin at all), and a saved pipelined plan (``saved``) runs as saved."""
        if entry not in ENTRIES:
            raise ValueError(f"entry {entry!r}: one of {list(ENTRIES)}")
        if self.compile_options is not None:
            if entry != "compile":
                raise TypeError(f"compile= is taken by autoshard.compile only: it compiles each rank's program and does "
                                f"not change the plan; drop it from {entry.replace('-', '_')}()")
        if self.layout is not None:
            if entry != "plan":
                raise TypeError(f"layout= is taken by autoshard.plan only: price it with plan = autoshard.plan(..., "
                                f"layout=...), then run that plan with {entry.replace('-', '_')}(..., plan=plan)")
            levers = {k: v for k, v in self.levers.items() if k != "mixed_precision"}
            check_layout_arguments(self.layout, pp=self.pp, schedule=self.schedule, microbatches=self.microbatches,
                                   stages=self.stages, random_seed=self.random_seed, expert_load=self.expert_load,
                                   **levers, **dict(self.pins))
            return
        if saved is not None and saved.pipelined:
            if self.levers:
                raise TypeError(f"{sorted(self.levers, key=lever_keywords().index)} cannot be combined with a saved "
                                "pipelined plan: its stages run the levers they were planned with; plan again with "
                                "them (autoshard.plan(..., pp=..., checkpoint=...))")
            self._check_saved_pipeline(saved)
            return
        if entry == "plan-captured" and any(v is not None for v in (self.pp, self.schedule, self.microbatches,
                                                                     self.stages)):
            raise TypeError("plan_captured plans the captured program as it is, with no pipeline stages: drop pp=, "
                            "schedule=, microbatches= and stages=, or use autoshard.plan(..., pp=...)")
        if not self.pipelined:
            if any(v is not None for v in (self.schedule, self.microbatches, self.stages)):
                raise TypeError("schedule=, microbatches= and stages= configure pipeline parallelism: pass pp='auto' "
                                "(or pp= > 1) too")
            return
        if entry == "plan":
            bad = ["random_seed"] if self.random_seed is not None else []
            bad += [f"{k} (pins)" for k in PIN_KEYWORDS if self.pins.get(k)]
            if bad:
                raise TypeError(f"{', '.join(bad)} cannot be combined with plan(..., pp={self.pp!r}): the stage planner "
                                "chooses each stage's sharding (compile(..., pp=..., params=...) applies parameter "
                                "pins when it re-solves the stages)")
            return
        bad = [k for k, v in (("plan", saved), ("random_seed", self.random_seed)) if v is not None]
        bad += [f"{k} (pins)" for k in ("inputs", "ops", "strategies") if self.pins.get(k)]
        if bad:
            raise TypeError(f"{', '.join(bad)} cannot be combined with pp={self.pp!r}: a pipeline is planned per stage "
                            "(only params= pins apply, to the stages holding those parameters)")

    def _check_saved_pipeline(self, plan) -> None:
        bad = []
        if self.pp not in (None, "auto", plan.pp):
            bad.append(f"pp={self.pp!r} (the plan has pp={plan.pp})")
        if self.schedule not in (None, plan.schedule):
            bad.append(f"schedule={self.schedule!r} (the plan runs {plan.schedule!r})")
        if self.microbatches not in (None, plan.microbatches):
            bad.append(f"microbatches={self.microbatches!r} (the plan cuts {plan.microbatches})")
        if self.stages is not None:
            bad.append("stages=")
        if self.random_seed is not None:
            bad.append("random_seed=")
        bad += [f"{k}= (pins)" for k, v in self.pins.items() if v]
        if bad:
            raise TypeError(f"compile(..., plan=<a pipelined plan>) runs the plan as saved; drop {', '.join(bad)} or "
                            "plan again with them (autoshard.plan(..., pp=...))")

