"""``PipelinedPlan``: a 3D plan (pipeline stages on rank groups, each stage with its intra-op plan).

What ``autoshard.plan(model, mesh, ..., pp="auto" | N)`` returns when the stage planner pipelines,
with the same surface as ``Plan``: ``summary()``, ``render(path)``, ``save(path)``,
``estimated_step_time``, ``estimated_memory``, the throughput and MFU properties, and
``autoshard.load_plan`` reads it back (JSON, never pickle). ``autoshard.compile(..., plan=it)``
builds the pipeline from it under torchrun without planning again.

The decisions are ``pipeline``, a ``passes.pipeline.stages.stage_plan.PipelinePlan`` made on the
program traced at the GLOBAL batch: the stage cut (node names of that program), each stage's rank
group, ranks and logical submesh, its intra-op ``Solution``, whether it recomputes activations, the
schedule and the microbatch count. Its estimates are the schedule simulator's.
``batch_coupled``: the program's batch-coupled ops (``passes.batch_coupling``), which a pipeline runs
per microbatch (BatchNorm normalises each microbatch on its own); ``summary()`` says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from autoshard.drawing import block_pipeline_to_dot, pipeline_to_dot
from autoshard.metrics import ModelWork
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan, StagePlan
from autoshard.plan_format import PIPELINED_FORMAT, PLAN_VERSION, check_envelope
from autoshard.plan_surface import PlanSurface
from autoshard.summary import pipelined_summary

__all__ = ["PipelinedPlan", "CompiledPipelinePlan"]


@dataclass
class PipelinedPlan(PlanSurface):
    """A pipeline plan of one program on the physical ``mesh`` (see the module docstring). Throughput,
    MFU, ``render`` and ``save`` come from ``PlanSurface``, shared with ``Plan``."""
    pipeline: PipelinePlan
    mesh: Mesh
    hardware: str
    fingerprint: str
    captured: Optional[CapturedGraph] = field(default=None, repr=False)
    work: Optional[ModelWork] = None
    batch_coupled: list[str] = field(default_factory=list)

    # ---- the decisions -------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        """Number of pipeline rank groups (along the mesh's first axis)."""
        return self.pipeline.pp

    @property
    def virtual(self) -> int:
        """Stages per rank group (2 for interleaved and V schedules)."""
        return self.pipeline.virtual

    @property
    def schedule(self) -> str:
        return self.pipeline.schedule

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches

    @property
    def stages(self) -> list[StagePlan]:
        """The ``pp * virtual`` stages in pipeline order."""
        return list(self.pipeline.stages)

    @property
    def param_placements(self) -> dict:
        """Parameter name -> storage placements on the submesh of the stage that holds it (a tied weight
        held by two stages: the first holder's)."""
        out: dict = {}
        for stage in self.pipeline.stages:
            if stage.solution is not None:
                for name, pls in stage.solution.param_placements.items():
                    out.setdefault(name, pls)
        return out

    @property
    def estimated_step_time(self) -> float:
        """Simulated seconds per training step (the schedule simulator, bubbles and overlap included)."""
        return float(self.pipeline.estimated_step_time)

    @property
    def estimated_memory(self) -> int:
        """Estimated bytes on the busiest device: the largest stage estimate (a rank group holding several
        stages sums them)."""
        per_group: dict[int, float] = {}
        for stage in self.pipeline.stages:
            if stage.solution is not None:
                per_group[stage.group] = per_group.get(stage.group, 0.0) + stage.solution.estimated_memory
        return int(max(per_group.values(), default=0.0))

    @property
    def bubble_fraction(self) -> float:
        return float(self.pipeline.bubble_fraction)

    # ---- reading it ---------------------------------------------------------------------------
    def summary(self) -> str:
        """Mesh, pipeline, estimates (step time, memory, throughput, MFU), stages and placements."""
        return pipelined_summary(self)

    def to_dot(self, detail: str = "blocks") -> str:
        """Graphviz dot text (needs the captured graph). ``detail="blocks"``: stages as boxes of module
        segments, identical stages and repeated blocks folded; ``detail="ops"``: every op, one
        cluster per stage (``drawing.pipeline_graph``)."""
        if self.captured is None:
            raise ValueError("this plan has no captured graph (it was loaded from JSON): attach it to the traced "
                             "model first, e.g. plan.attach(capture(model, inputs, ...), mesh)")
        if detail == "blocks":
            return block_pipeline_to_dot(self)
        if detail == "ops":
            return pipeline_to_dot(self.pipeline, self.captured)
        raise ValueError(f"detail={detail!r}: choose 'blocks' (the default) or 'ops'")

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": PIPELINED_FORMAT, "version": PLAN_VERSION, "mesh": self.mesh.to_json(),
                "hardware": self.hardware, "fingerprint": self.fingerprint,
                "work": self.work.to_json() if self.work else None, "pipeline": self.pipeline.to_json(),
                "batch_coupled": list(self.batch_coupled)}

    @classmethod
    def from_json(cls, data: Any) -> "PipelinedPlan":
        check_envelope(data, PIPELINED_FORMAT)
        try:
            return cls(PipelinePlan.from_json(data["pipeline"]), Mesh.from_json(data["mesh"]), str(data["hardware"]),
                       str(data["fingerprint"]), work=ModelWork.from_json(data.get("work")),
                       batch_coupled=[str(c) for c in data.get("batch_coupled", [])])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanFormatError(f"malformed pipelined plan ({type(e).__name__}: {e}); was it written by "
                                  "PipelinedPlan.save?") from e

    def attach(self, captured: CapturedGraph, mesh: Any = None) -> "PipelinedPlan":
        """This plan bound to ``captured`` (the program traced at the global batch); raises
        PlanFormatError if it was made for another program or mesh."""
        self.check_binds(captured, mesh)
        return PipelinedPlan(self.pipeline, self.mesh, self.hardware, self.fingerprint, captured, self.work,
                             list(self.batch_coupled))


@dataclass
class CompiledPipelinePlan(PipelinePlan):
    """``PipelinedModel.plan``: the ``PipelinePlan`` a compiled pipeline runs (stages traced and sharded
    at microbatch shapes), with the physical ``mesh``, the ``hardware`` label and the model's ``work``,
    so ``summary()`` prints it as ``PipelinedPlan.summary`` does."""
    mesh: Optional[Mesh] = None
    hardware: str = ""
    work: Optional[ModelWork] = None
    batch_coupled: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, plan: PipelinePlan, mesh: Mesh, hardware: str, work: Optional[ModelWork] = None,
           batch_coupled: Optional[list[str]] = None) -> "CompiledPipelinePlan":
        return cls(**{f.name: getattr(plan, f.name) for f in fields(PipelinePlan)}, mesh=mesh, hardware=hardware,
                   work=work, batch_coupled=list(batch_coupled or []))

    def summary(self) -> str:
        """Mesh, pipeline, estimates, stages and placements (``PipelinedPlan.summary``), and the
        batch-coupled ops that see one microbatch at a time."""
        plain = PipelinePlan(**{f.name: getattr(self, f.name) for f in fields(PipelinePlan)})
        text = PipelinedPlan(plain, self.mesh, self.hardware, "", work=self.work,
                             batch_coupled=list(self.batch_coupled)).summary()
        report = getattr(self, "compile_report", None)  # set by PipelinedModel under compile=
        return text if report is None else "\n".join([text, *report.lines()])
