"""``Plan``: how a model runs on a mesh. A list of stages, one without a pipeline, under a schedule.

Every plan the compiler makes, saves, loads and runs is this one type:

- without a pipeline it has ONE stage holding every op on the whole mesh, with the sharding
  planner's ``Solution`` (``autoshard.plan(model, mesh)``);
- a pipeline (``pp=``) cuts the program into ``pp * virtual`` stages: the physical mesh's FIRST axis
  is split among ``pp`` rank groups, each owning a contiguous block of ranks and running its stages
  on a logical submesh (``Stage.mesh``, e.g. (dp, tp) = (2, 2)) with the intra-op ``Solution`` chosen
  for that stage's sub-program. With virtual stages (interleaved 1F1B, ZBV, DualPipeV) rank group g
  owns several stages; stage s lives on group ``stages[s].group``. ``schedule`` (a name the schedule
  registry knows, ``schedule/registry.py``) orders them over ``microbatches`` microbatches.

Each stage's ``Solution`` carries its own memory levers (``passes.levers.Levers``: block
checkpointing, reshard after forward, mixed precision), so every lever is chosen per stage. The
step-level ``accumulation`` (k, recorded in every stage's levers) runs the schedule k times per step,
each round on 1/k of the batch (``runtime.executor``).

Stage boundaries are node names of ``captured``: stage s holds the call_function nodes in
``Stage.nodes`` (a topologically contiguous slice of the graph, in graph order). A value produced in
stage a and read in stage b > a is sent straight from a to b. Parameters read by several stages (tied
weights) are held by each and owned by the first (the runtime keeps the copies equal).

``captured``: the program the stages were planned on: for a plan the runtime runs, one microbatch's
(the global batch / (accumulation x microbatches)); for a pipeline as the stage planner chose it, one
round's (the batch / accumulation), which ``autoshard.driver.to_microbatch`` moves onto the
microbatch program. A plan is data: ``to_json``/``from_json`` (``plan_file``: never pickle), and a
loaded plan re-attaches to its program (``attach``) after checking the graph's fingerprint.

People read a plan through views the front door registers (``register_view``: ``autoshard.summary``,
``autoshard.drawing``, ``autoshard.explain``), as the runtime registers its lowerings' emitters:
``summary()``, ``to_dot()``, ``render()``, ``explain()``. Throughput and MFU follow ``plan_work``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import Levers
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.group_peak import group_peaks
from autoshard.passes.pipeline.plan_file import PLAN_FORMAT, PLAN_VERSION, graph_fingerprint, upgraded
from autoshard.passes.pipeline.plan_work import ModelWork, hardware_label, plan_work
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.schedule.simulate import ScheduleError
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import Strategy

__all__ = ["Stage", "Plan", "register_view", "VIEWS"]

#: how people read a plan: view name ("summary", "to_dot", "render_dot", "explain") -> function,
#: registered by the front door (``autoshard.plans``) when it is imported
VIEWS: dict[str, Callable] = {}


def register_view(name: str, fn: Callable) -> None:
    """Register the front door's ``fn`` as the plan view ``name`` (see the module docstring)."""
    VIEWS[name] = fn


def _view(name: str) -> Callable:
    if name not in VIEWS:
        raise RuntimeError(f"no plan view {name!r} is registered: import autoshard.plans (the front door registers "
                           "the summary, the pictures and explain there)")
    return VIEWS[name]


def call_nodes_of(captured: CapturedGraph) -> list[str]:
    """The program's call_function node names, in graph order: the ops of a plan of one stage."""
    return [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]


@dataclass
class Stage:
    """One stage: its ops, its rank group, the group's global ranks and logical submesh, its sharding
    (with its memory levers) and whether it recomputes its whole forward in the backward."""
    index: int
    nodes: list[str]
    group: int
    ranks: list[int]
    mesh: Mesh
    solution: Optional[Solution] = None
    recompute: bool = False

    def to_json(self) -> dict:
        return {"index": self.index, "nodes": list(self.nodes), "group": self.group, "ranks": list(self.ranks),
                "mesh": self.mesh.to_json(), "recompute": self.recompute,
                "solution": None if self.solution is None else self.solution.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "Stage":
        return cls(int(d["index"]), list(d["nodes"]), int(d["group"]), [int(r) for r in d["ranks"]],
                   Mesh.from_json(d["mesh"]), None if d.get("solution") is None else Solution.from_json(d["solution"]),
                   bool(d.get("recompute", False)))


@dataclass
class Plan:
    """See the module docstring. ``simulated_step_time``: the schedule simulator's step (a pipeline;
    None: the one stage's Solution's estimate). ``batch_coupled``: the program's batch-coupled ops
    (``passes.batch_coupling``), which a pipeline runs per microbatch. ``source``: how ``autoshard
    plan`` built the model (JSON data; ``autoshard explain`` builds it again from it). ``work``: one
    step's model FLOPs, tokens and the hardware's peak (filled from ``captured`` when not given)."""
    stages: list[Stage]
    mesh: Mesh
    schedule: str = "1f1b"
    microbatches: int = 1
    hardware: str = ""
    fingerprint: str = ""
    captured: Optional[CapturedGraph] = field(default=None, repr=False)
    work: Optional[ModelWork] = None
    simulated_step_time: Optional[float] = None
    bubble_fraction: float = 0.0
    peak_activation_memory: list[float] = field(default_factory=list)
    batch_coupled: list[str] = field(default_factory=list)
    source: Optional[dict] = None

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a plan has at least one stage")
        if len(self.stages) > 1:
            try:
                desc = get_schedule(self.schedule)
            except ScheduleError as err:
                raise ValueError(str(err)) from None
            if len(self.stages) % self.pp:
                raise ValueError(f"{len(self.stages)} stages on {self.pp} rank groups: each group needs as many")
            if desc.virtual_stages != self.virtual:
                raise ValueError(f"schedule {self.schedule!r} runs {desc.virtual_stages} stage(s) per rank group, "
                                 f"but the plan has {self.virtual} ({len(self.stages)} stages on {self.pp} groups)")
        if self.work is None and self.captured is not None and self.hardware:
            self.work = plan_work(self.captured, self.hardware, self.mesh.size, self._levers())

    # ---- making one ----------------------------------------------------------------------------
    @classmethod
    def of_solution(cls, solution: Solution, mesh: Mesh, hardware: Any, captured: CapturedGraph) -> "Plan":
        """The plan of one stage running ``solution`` of ``captured`` on the whole ``mesh``;
        ``hardware``: a preset name, a profile path or a ``Hardware``."""
        stage = Stage(0, call_nodes_of(captured), 0, list(range(mesh.size)), mesh, solution)
        return cls([stage], mesh, hardware=hardware_label(hardware), fingerprint=graph_fingerprint(captured),
                   captured=captured, work=plan_work(captured, hardware, mesh.size, solution.levers))

    @classmethod
    def of_strategies(cls, captured: CapturedGraph, strategies: dict[str, Strategy], mesh: Any,
                      levers: Optional[Levers] = None) -> "Plan":
        """A plan of one stage from placements alone (no estimates): ``strategies`` for every node of
        ``captured``, with ``levers`` (default: none pulled). What tests build programs from."""
        mesh = Mesh.of(mesh)
        solution = Solution(mesh, dict(strategies), {}, levers=levers if levers is not None else Levers())
        stage = Stage(0, call_nodes_of(captured), 0, list(range(mesh.size)), mesh, solution)
        return cls([stage], mesh, fingerprint=graph_fingerprint(captured), captured=captured)

    # ---- the pipeline --------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        """Number of rank groups along the mesh's first axis (1 without a pipeline)."""
        return len({s.group for s in self.stages})

    @property
    def virtual(self) -> int:
        """Stages per rank group (2 for interleaved and V schedules)."""
        return len(self.stages) // self.pp

    @property
    def pipelined(self) -> bool:
        """Whether the program is cut into several stages."""
        return len(self.stages) > 1

    @property
    def accumulation(self) -> int:
        """Rounds per step: the schedule runs this many times, each on 1/accumulation of the batch."""
        return self._levers().accumulation

    def _levers(self) -> Levers:
        return next((s.solution.levers for s in self.stages if s.solution is not None), Levers())

    # ---- the decisions -------------------------------------------------------------------------
    @property
    def solution(self) -> Solution:
        """The one stage's ``Solution``; a pipelined plan has one per stage (``stages[s].solution``)."""
        if self.pipelined:
            raise AttributeError(f"a pipelined plan has one Solution per stage: read plan.stages[s].solution "
                                 f"(s in 0..{len(self.stages) - 1})")
        return self.stages[0].solution

    @property
    def param_placements(self) -> dict:
        """Parameter name (as in ``model.named_parameters()``, tied aliases included) -> tuple of storage
        placements, one per axis of the mesh (of a pipeline: the submesh of the first stage holding it)."""
        out: dict = {}
        for stage in self.stages:
            if stage.solution is not None:
                for name, pls in stage.solution.param_placements.items():
                    out.setdefault(name, pls)
        return out

    @property
    def strategies(self) -> dict:
        """Node name -> ``Strategy`` for every placeholder and op (a placeholder read by several stages:
        the first stage's)."""
        out: dict = {}
        for stage in self.stages:
            if stage.solution is not None:
                for name, st in stage.solution.strategies.items():
                    out.setdefault(name, st)
        return out

    @property
    def replicated_ops(self) -> list:
        """Ops with no sharding rule, which therefore run replicated."""
        if not self.pipelined:
            return list(self.solution.unruled_ops)
        return sorted({op for s in self.stages if s.solution is not None for op in s.solution.unruled_ops})

    # ---- estimates -----------------------------------------------------------------------------
    @property
    def estimated_step_time(self) -> float:
        """Estimated seconds for one training step: the one stage's Solution's (forward, backward,
        gradient sync), or a pipeline's simulated step (bubbles and overlap included)."""
        if self.simulated_step_time is not None:
            return float(self.simulated_step_time)
        if not self.pipelined and self.stages[0].solution is not None:
            return float(self.stages[0].solution.estimated_step_time)
        return 0.0

    def _group_memory(self) -> dict[int, float]:
        """Per rank group, its peak bytes per device (``group_peak``: several stages of a group run
        one at a time)."""
        return group_peaks(((s.index, s.group, None if s.solution is None else s.solution.estimated,
                             0.0 if s.solution is None else s.solution.estimated_memory) for s in self.stages),
                           self.schedule, self.pp, self.microbatches)

    @property
    def estimated_memory(self) -> int:
        """Estimated bytes on the busiest device at the step's peak (``passes.solve.peak_timeline``; a
        pipeline stage's whole-step peak, ``stage_peak``; a rank group holding several stages: its
        stages' kept bytes at the schedule's worst moment plus the running one's working set, ``group_peak``):
        parameters, gradients, optimizer state, activations, gathered copies, buffers; ``memory_peak_phase``
        says where. Rounded up to whole bytes: given back as ``memory_limit``, it admits this plan."""
        return math.ceil(max(self._group_memory().values(), default=0.0))

    @property
    def memory_peak_phase(self) -> str:
        """The phase (and node) of the step that sets ``estimated_memory``: "forward (node)", "backward
        (node)" or "optimizer step" (of a pipeline: of the busiest group's largest stage)."""
        if not self.pipelined:
            return self.solution.memory_peak_phase
        groups = self._group_memory()
        if not groups:
            return ""
        busiest = max(groups, key=groups.get)
        stage = max((s for s in self.stages if s.group == busiest and s.solution is not None),
                    key=lambda s: s.solution.estimated_memory)
        return f"stage {stage.index}: {stage.solution.memory_peak_phase}" if stage.solution.memory_peak_phase else ""

    @property
    def model_flops(self) -> Optional[float]:
        """Model FLOPs of one step over all devices (``plan_work``: matmul FLOPs x3 for training)."""
        return self.work.flops if self.work else None

    @property
    def tokens_per_second_per_device(self) -> Optional[float]:
        """Estimated tokens per second per device (None when the inputs carry no token ids)."""
        return self.work.rate(self.estimated_step_time) if self.work and self.work.tokens else None

    @property
    def samples_per_second_per_device(self) -> Optional[float]:
        """Estimated samples (rows of the global batch) per second per device."""
        return self.work.samples_rate(self.estimated_step_time) if self.work else None

    @property
    def mfu(self) -> Optional[float]:
        """Estimated model FLOPs utilization against the hardware's dense peak (0..1; ``plan_work``)."""
        return self.work.mfu(self.estimated_step_time) if self.work else None

    # ---- reading it (the front door's views) ---------------------------------------------------
    def summary(self) -> str:
        """A human-readable account: mesh, estimates, the pipeline (when there is one), placements,
        collectives, ops without a rule (``autoshard.summary``)."""
        return _view("summary")(self)

    def to_dot(self, detail: str = "blocks") -> str:
        """The partition as graphviz dot text (needs the captured graph). ``detail="blocks"``: one box per
        module segment, repeated blocks (and identical stages) folded, placements per mesh axis and the
        collectives at their edges; ``detail="ops"``: every op and every inserted collective
        (``autoshard.drawing``). A pipeline's stages are clusters with their cuts."""
        if detail not in ("blocks", "ops"):
            raise ValueError(f"detail={detail!r}: choose 'blocks' (the default) or 'ops'")
        if self.captured is None:
            raise ValueError("this plan has no captured graph (it was loaded from JSON): attach it to the traced "
                             "model first, e.g. plan.attach(capture(model, inputs, ...), mesh)")
        return _view("to_dot")(self, detail)

    def render(self, path: str, detail: str = "blocks") -> str:
        """Draw the plan to ``path`` (.svg, .png or .pdf) at ``detail`` (see ``to_dot``). Without
        graphviz's ``dot`` program, writes ``path`` with suffix .dot instead and raises RuntimeError
        saying how to render it."""
        return _view("render_dot")(self.to_dot(detail), path)

    def explain(self, name: str, **kwargs):
        """Why parameter or op ``name`` got its placement: the other strategies priced against the choice
        and the binding constraint (``autoshard.explain``; needs the captured graph)."""
        return _view("explain")(self, name, **kwargs)

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "mesh": self.mesh.to_json(),
               "hardware": self.hardware, "fingerprint": self.fingerprint,
               "work": self.work.to_json() if self.work else None, "schedule": self.schedule,
               "microbatches": self.microbatches, "stages": [s.to_json() for s in self.stages],
               "simulated_step_time": self.simulated_step_time, "bubble_fraction": self.bubble_fraction,
               "peak_activation_memory": list(self.peak_activation_memory),
               "batch_coupled": list(self.batch_coupled)}
        if self.source is not None:
            out["source"] = self.source
        return out

    @classmethod
    def from_json(cls, data: Any) -> "Plan":
        """A plan from its JSON object (this version's or version 1's, ``plan_file.upgraded``)."""
        data = upgraded(data)
        try:
            simulated = data.get("simulated_step_time")
            return cls([Stage.from_json(s) for s in data["stages"]], Mesh.from_json(data["mesh"]),
                       str(data.get("schedule", "1f1b")), int(data.get("microbatches", 1)), str(data["hardware"]),
                       str(data["fingerprint"]), work=ModelWork.from_json(data.get("work")),
                       simulated_step_time=None if simulated is None else float(simulated),
                       bubble_fraction=float(data.get("bubble_fraction", 0.0)),
                       peak_activation_memory=[float(x) for x in data.get("peak_activation_memory", [])],
                       batch_coupled=[str(c) for c in data.get("batch_coupled", [])], source=data.get("source"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanFormatError(f"malformed plan ({type(e).__name__}: {e}); was it written by Plan.save?") from e

    def save(self, path: str) -> None:
        """Write the plan as JSON (never pickle); ``autoshard.load_plan`` reads it back."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def check_binds(self, captured: CapturedGraph, mesh=None) -> None:
        """Raise ``PlanFormatError`` unless this plan was made for ``captured``'s program (its graph
        fingerprint) and, when given, for ``mesh``'s shape."""
        if mesh is not None and Mesh.of(mesh).shape != self.mesh.shape:
            raise PlanFormatError(f"plan was made for mesh {self.mesh.shape}, not {Mesh.of(mesh).shape}: plan again")
        fp = graph_fingerprint(captured)
        if fp != self.fingerprint:
            raise PlanFormatError(
                "plan was made for a different model or input shapes (graph fingerprint "
                f"{self.fingerprint} != {fp}): plan again for this model")

    def attach(self, captured: CapturedGraph, mesh: Any = None) -> "Plan":
        """This plan bound to ``captured`` (a copy; the stages are shared); raises PlanFormatError if it
        was made for another graph or mesh. A plan of one stage loaded from a version-1 file gets its
        op list here."""
        self.check_binds(captured, mesh)
        stages = self.stages
        if len(stages) == 1 and not stages[0].nodes:
            stages = [replace(stages[0], nodes=call_nodes_of(captured))]
        return replace(self, stages=stages, captured=captured)

    def with_stages(self, stages: list[Stage], captured: Optional[CapturedGraph] = None) -> "Plan":
        """This plan with other ``stages`` (the same cut, schedule and estimates), bound to ``captured``
        when given (its fingerprint then)."""
        if captured is None:
            return replace(self, stages=list(stages))
        return replace(self, stages=list(stages), captured=captured, fingerprint=graph_fingerprint(captured))
