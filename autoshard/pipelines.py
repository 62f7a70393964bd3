"""3D plans at the front door: plan a pipeline with no process group, and build one from a saved plan.

``plan_pipelined(captured, mesh, ...)`` is ``autoshard.plan(..., pp=...)``'s part: the stage planner
(``passes.pipeline.stages.planner.plan_pipeline``) on the program traced at the global batch, on
the physical mesh, with no process group; it returns a ``PipelinedPlan``, or a ``Plan`` when the
planner finds no pipeline faster (pp = 1). A model of many identical blocks is planned through its
shallow copy inside the planner (``passes.pipeline.stages.shallow``): pass the whole model.

``build_pipelined_model(plan, model, ...)`` is ``autoshard.compile(..., plan=pipelined_plan)``'s
part, on every rank of a world the size of the plan's mesh: no planning. It traces the model at the
global batch (the plan's fingerprint must match) and at the microbatch size (what stage programs
run), moves the plan's decisions onto the microbatch program (``microbatch_plan``: the same ops,
paired by position or, when the traces differ in a few ops as HF models' do at one sequence, by
aligning them (``split.align_nodes``); the same strategies: the planner only chose strategies that
divide the microbatch) and builds this rank's stages (``runtime.pipeline.PipelineProgram``).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Any, Optional, Union

import torch

from autoshard.compiled import PipelinedModel
from autoshard.lever_args import microbatch
from autoshard.passes.batch_coupling import batch_coupled_ops, describe_coupled
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import BatchCouplingWarning, BatchError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.generators import generate
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan, StagePlan
from autoshard.passes.solve.solution import Redistribution, Solution
from autoshard.pipelined_plans import CompiledPipelinePlan, PipelinedPlan
from autoshard.plan_format import graph_fingerprint
from autoshard.plans import Plan, plan_work
from autoshard.runtime.pipeline.executor import PipelineProgram
from autoshard.runtime.pipeline.split import align_nodes, retrace_stage_nodes

__all__ = ["plan_pipelined", "build_pipelined_model", "microbatch_plan", "check_plan_arguments",
           "warn_per_microbatch"]


def plan_pipelined(captured: CapturedGraph, mesh: Mesh, *, hardware: Any, hardware_label: str,
                   memory_limit: Optional[int], optimizer: str, pp: Union[int, str], schedule: Optional[str],
                   microbatches: Optional[int], stages: Optional[list], time_limit_s: float
                   ) -> Union[PipelinedPlan, Plan]:
    """The stage planner's choice for ``captured`` on ``mesh`` as a plan object (module docstring).
    ``stages``: unit indices or node names where stages 1.. start (``api.planner_stage_starts``)."""
    chosen = plan_pipeline(captured, mesh, hardware=hardware, memory_limit=memory_limit, optimizer=optimizer,
                           pp=None if pp == "auto" else pp, schedule=schedule, microbatches=microbatches,
                           stages=stages, time_limit_s=time_limit_s)
    if chosen.pp == 1:
        return Plan.build(chosen.stages[0].solution, mesh, hardware, captured)
    return PipelinedPlan(chosen, mesh, hardware_label, graph_fingerprint(captured), captured,
                         plan_work(captured, hardware, mesh.size),
                         warn_per_microbatch(captured, chosen.microbatches))


def warn_per_microbatch(captured: CapturedGraph, microbatches: int) -> list[str]:
    """A pipeline of ``microbatches > 1`` runs batch-coupled ops (``passes.batch_coupling``) on each
    microbatch alone: warn (``BatchCouplingWarning``, naming them) and return their descriptions."""
    coupled = batch_coupled_ops(captured)
    if coupled and microbatches > 1:
        warnings.warn(f"this pipeline runs {microbatches} microbatches, and batch-coupled ops see one microbatch "
                      f"at a time ({describe_coupled(coupled)}): the step differs from one device on the whole "
                      "batch. Plan without pp= to keep the maths of the full batch", BatchCouplingWarning,
                      stacklevel=3)
    return [c.describe() for c in coupled]


def check_pipeline_inputs(example_inputs) -> None:
    """Pipelines cut every input tensor along dim 0: a tuple of positional inputs or a dict of keyword
    inputs (Hugging Face), as ``compile`` takes them; anything else is a BatchError."""
    if isinstance(example_inputs, torch.Tensor) or isinstance(example_inputs, (tuple, list, dict)):
        return
    raise BatchError(f"pipeline parallelism takes example_inputs as a tuple of tensors or a dict of keyword tensors "
                     f"(cut along dim 0), got {type(example_inputs).__name__}")


def microbatch_inputs(example_inputs, example_target, m: int):
    """``(inputs, target)`` of one of ``m`` pipeline microbatches: the first rows of every tensor."""
    check_pipeline_inputs(example_inputs)
    return microbatch(example_inputs, example_target, m, keyword="microbatches")


def check_plan_arguments(plan: PipelinedPlan, *, pp, schedule, microbatches, stages, random_seed, pins: dict) -> None:
    """``compile(..., plan=pipelined_plan)`` takes its pipeline from the plan: a pipeline keyword that
    contradicts it, a random seed or a pin is a TypeError naming it."""
    bad = []
    if pp not in (None, "auto", plan.pp):
        bad.append(f"pp={pp!r} (the plan has pp={plan.pp})")
    if schedule not in (None, plan.schedule):
        bad.append(f"schedule={schedule!r} (the plan runs {plan.schedule!r})")
    if microbatches not in (None, plan.microbatches):
        bad.append(f"microbatches={microbatches!r} (the plan cuts {plan.microbatches})")
    if stages is not None:
        bad.append("stages=")
    if random_seed is not None:
        bad.append("random_seed=")
    bad += [f"{k}= (pins)" for k, v in pins.items() if v]
    if bad:
        raise TypeError(f"compile(..., plan=<PipelinedPlan>) runs the plan as saved; drop {', '.join(bad)} or plan "
                        "again with them (autoshard.plan(..., pp=...))")


def _renamed(solution: Optional[Solution], names: dict[str, str]) -> Optional[Solution]:
    """``solution`` on the other trace: decisions about values it lacks are dropped."""
    if solution is None:
        return None
    moves = [Redistribution(names[r.producer], names[r.consumer], r.operand_index, r.src, r.dst, r.collectives)
             for r in solution.redistributions if r.producer in names and r.consumer in names]
    return replace(solution, strategies={names[k]: v for k, v in solution.strategies.items() if k in names},
                   redistributions=moves)


def microbatch_plan(pipeline: PipelinePlan, full: CapturedGraph, small: CapturedGraph) -> PipelinePlan:
    """``pipeline`` (made on ``full``, the program at the global batch) on ``small``, the same program
    traced at the microbatch size: every node renamed to its counterpart (ops by ``split.align_nodes``,
    placeholders by position), the stage boundaries moved with them (``split.retrace_stage_nodes``),
    decisions and estimates unchanged. An op only the microbatch trace has gets no decision from the
    plan: ``PlanFormatError`` naming it (compile with ``pp=`` to plan at the microbatch instead)."""
    names = align_nodes(full, small)
    a = [n.name for n in full.gm.graph.nodes if n.op == "placeholder"]
    b = [n.name for n in small.gm.graph.nodes if n.op == "placeholder"]
    if len(a) != len(b):
        raise PlanFormatError(f"the program traced at the microbatch size has {len(b)} placeholders, at the global "
                              f"batch {len(a)}: the model's parameters or inputs depend on the batch size")
    names.update(zip(a, b))
    stage_nodes = retrace_stage_nodes(full, small, [s.nodes for s in pipeline.stages])
    stages = []
    for s, nodes in zip(pipeline.stages, stage_nodes):
        solution = _renamed(s.solution, names)
        new = [n for n in nodes if solution is not None and n not in solution.strategies]
        if new:
            raise PlanFormatError(f"the program traced at the microbatch size has ops the plan's trace lacks "
                                  f"({new[:5]}, stage {s.index}); the saved plan has no decision for them: compile "
                                  "with pp= (and the plan's schedule and microbatches) to plan at the microbatch")
        stages.append(StagePlan(s.index, nodes, s.group, list(s.ranks), s.mesh, solution, s.recompute))
    return PipelinePlan(pipeline.pp, pipeline.virtual, stages, pipeline.schedule, pipeline.microbatches,
                        pipeline.estimated_step_time, pipeline.bubble_fraction, list(pipeline.peak_activation_memory))


def build_pipelined_model(plan: PipelinedPlan, model: torch.nn.Module, *, example_inputs, loss_fn=None,
                          example_target=None, state_dict: Optional[dict] = None, device: Any = None,
                          full: Optional[CapturedGraph] = None, small: Optional[CapturedGraph] = None
                          ) -> PipelinedModel:
    """This rank's ``PipelinedModel`` for ``plan`` (module docstring); ``torch.distributed`` must be
    initialized with the plan's world. ``device``: where the local shards live (default: the
    backend's device; "meta" builds the programs without allocating, for inspection). ``full`` /
    ``small``: the model already traced at the global batch / at the microbatch size (a caller
    building several ranks' programs in one process traces once)."""
    t0 = time.perf_counter()
    check_pipeline_inputs(example_inputs)
    full = full if full is not None else capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
    plan.attach(full)
    m = plan.microbatches
    if small is None:
        small_inputs, small_target = microbatch_inputs(example_inputs, example_target, m)
        small = capture(model, small_inputs, loss_fn=loss_fn, target=small_target)
    runtime = microbatch_plan(plan.pipeline, full, small)
    program = PipelineProgram(small, runtime, generate(runtime.schedule, runtime.pp, m, runtime.virtual), model=model,
                              state_dict=state_dict, device=device)
    return PipelinedModel(CompiledPipelinePlan.of(runtime, plan.mesh, plan.hardware, plan.work, plan.batch_coupled),
                          program,
                          compile_seconds=time.perf_counter() - t0, planner_plan=plan.pipeline)
