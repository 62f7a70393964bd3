"""``Plan``: the solver's decisions for one model on one mesh, with its estimates and pictures.

A Plan is data: it saves to JSON (``Plan.save``) and loads back without executing code
(``autoshard.load_plan``, which reads a ``PipelinedPlan`` too). It keeps the captured graph when it
has one (for drawing and compiling); a loaded plan carries only the decisions and re-attaches to a
graph when compiled, after checking that the graph's fingerprint matches. Its throughput and MFU
follow ``autoshard.metrics``' conventions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from autoshard.drawing import block_plan_to_dot, plan_to_dot
from autoshard.metrics import ModelWork, model_work
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import AutoshardError, PlanFormatError
from autoshard.explain import explain
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import fmt_placements
from autoshard.pipelined_plans import PipelinedPlan
from autoshard.plan_surface import PlanSurface
from autoshard.plan_format import (PIPELINED_FORMAT, PLAN_FORMAT, PLAN_VERSION, check_envelope, graph_fingerprint,
                                   read_plan_json)
from autoshard.summary import plan_summary

__all__ = ["Plan", "load_plan", "graph_fingerprint", "plan_work", "hardware_label", "PLAN_FORMAT", "PLAN_VERSION"]


def hardware_label(hardware) -> str:
    """How a plan records its hardware: the preset or profile path, or a ``Hardware`` object's name."""
    return hardware if isinstance(hardware, str) else str(getattr(hardware, "name", "custom"))


def plan_work(captured: CapturedGraph, hardware: Any, devices: int, solution: Optional[Solution] = None
              ) -> Optional[ModelWork]:
    """``metrics.model_work`` for a plan of ``captured``; the matmuls run in the mixed-precision compute
    dtype when ``solution``'s levers cast. None when ``hardware`` names no known hardware."""
    try:
        hw = get_hardware(hardware)
    except AutoshardError:
        return None
    levers = getattr(solution, "levers", None)
    mp = getattr(levers, "mixed_precision", None)
    return model_work(captured, hw, devices, compute_dtype=getattr(mp, "param_dtype", None))


@dataclass
class Plan(PlanSurface):
    """How every op, parameter and input is placed on the mesh, and what that is estimated to cost.
    Throughput, MFU, ``render`` and ``save`` come from ``PlanSurface``, shared with ``PipelinedPlan``."""
    solution: Solution
    mesh: Mesh
    hardware: str
    fingerprint: str
    captured: Optional[CapturedGraph] = field(default=None, repr=False)
    #: one step's model FLOPs, tokens and the hardware's peak (``metrics.ModelWork``); filled from
    #: ``captured`` when not given
    work: Optional[ModelWork] = None

    def __post_init__(self):
        if self.work is None and self.captured is not None:
            self.work = plan_work(self.captured, self.hardware, self.mesh.size, self.solution)

    @classmethod
    def build(cls, solution: Solution, mesh: Mesh, hardware: Any, captured: CapturedGraph) -> "Plan":
        """A plan of ``captured``: ``hardware`` a preset name, a profile path or a ``Hardware``."""
        return cls(solution, mesh, hardware_label(hardware), graph_fingerprint(captured), captured,
                   plan_work(captured, hardware, mesh.size, solution))
    #: how the model was built and planned when ``autoshard plan`` made it (spec, batch, seq, dtype,
    #: memory limit, optimizer): ``autoshard explain`` builds the same model again from it. JSON data.
    source: Optional[dict] = None
    #: under ``compile(..., compile=True)``: the rank's ``runtime.compiled_regions.CompileReport``, which
    #: ``summary()`` prints (never saved)
    compile_report: Any = field(default=None, repr=False, compare=False)

    # ---- the decisions -------------------------------------------------------------------------
    @property
    def param_placements(self) -> dict:
        """Parameter name (as in ``model.named_parameters()``, tied aliases included) -> tuple of
        placements, one per mesh axis (the storage placement each rank keeps)."""
        return dict(self.solution.param_placements)

    @property
    def strategies(self) -> dict:
        """Node name -> ``Strategy`` for every placeholder and op of the captured graph."""
        return dict(self.solution.strategies)

    @property
    def estimated_step_time(self) -> float:
        """Estimated seconds for one training step (forward, backward, gradient sync)."""
        return float(self.solution.estimated_step_time)

    @property
    def estimated_memory(self) -> int:
        """Estimated bytes on the busiest rank at the step's peak (``passes.solve.peak_timeline``):
        parameters, gradients, optimizer state and its temporaries, activations, gathered copies,
        gradients in flight, buffers of the gradient reduction; ``memory_peak_phase`` says where."""
        return int(self.solution.estimated_memory)

    @property
    def memory_peak_phase(self) -> str:
        """The phase (and node) of the step that sets ``estimated_memory``: "forward (node)",
        "backward (node)" or "optimizer step"."""
        return self.solution.memory_peak_phase

    @property
    def replicated_ops(self) -> list:
        """Ops with no sharding rule, which therefore run replicated."""
        return list(self.solution.unruled_ops)

    # ---- reading it ---------------------------------------------------------------------------
    def summary(self) -> str:
        """A human-readable account: mesh, estimates, parameter placements, inserted collectives."""
        return plan_summary(self)

    def explain(self, name: str, **kwargs):
        """Why parameter or op ``name`` got its placement: the other strategies priced against the choice
        and the binding constraint (``autoshard.explain``; needs the captured graph)."""
        return explain(self, name, **kwargs)

    def to_dot(self, detail: str = "blocks") -> str:
        """The partition as graphviz dot text (needs the captured graph). ``detail="blocks"``: one box
        per module segment, repeated blocks folded ("x32"), with placements per mesh axis and the
        collectives at their edges; ``detail="ops"``: every op and every inserted collective."""
        if detail == "blocks":
            return block_plan_to_dot(self)
        if detail == "ops":
            return plan_to_dot(self)
        raise ValueError(f"detail={detail!r}: choose 'blocks' (the default) or 'ops'")

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "mesh": self.mesh.to_json(),
            "hardware": self.hardware,
            "fingerprint": self.fingerprint,
            "work": self.work.to_json() if self.work else None,
            "solution": self.solution.to_json(),
            **({"source": self.source} if self.source is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        check_envelope(data, PLAN_FORMAT)
        try:
            return cls(
                solution=Solution.from_json(data["solution"]),
                mesh=Mesh.from_json(data["mesh"]),
                hardware=str(data["hardware"]),
                fingerprint=str(data["fingerprint"]),
                work=ModelWork.from_json(data.get("work")),
                source=data.get("source"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"malformed plan: {e}") from e

    def attach(self, captured: CapturedGraph, mesh: Mesh) -> "Plan":
        """This plan bound to ``captured``; raises PlanFormatError if it was made for another graph/mesh."""
        self.check_binds(captured, mesh)
        return Plan(self.solution, self.mesh, self.hardware, self.fingerprint, captured, self.work,
                    source=self.source)


def load_plan(path: str) -> Union[Plan, PipelinedPlan]:
    """Read a plan written by ``Plan.save`` or ``PipelinedPlan.save`` (JSON only; nothing is executed)."""
    data = read_plan_json(path)
    if data["format"] == PIPELINED_FORMAT:
        return PipelinedPlan.from_json(data)
    return Plan.from_json(data)


def describe_placements(pls) -> str:
    return fmt_placements(pls)
