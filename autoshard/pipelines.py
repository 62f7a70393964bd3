"""The front door's pipeline helpers, used by the driver (``autoshard.driver``).

- ``microbatch_plan(pipeline, full, small)``: a saved pipeline plan (made on the program traced at the
  global batch) moved onto the program traced at the microbatch size, which stage programs run: the
  same ops, paired by position or, when the traces differ in a few ops as HF models' do at one
  sequence, by aligning them (``passes.pipeline.stages.retrace.align_nodes``); the same strategies (the planner only chose
  strategies that divide the microbatch);
- ``warn_per_microbatch``: the batch-coupled ops a pipeline runs per microbatch;
- ``check_pipeline_inputs``: what inputs a pipeline can cut;
- ``planner_stage_starts``: the ``stages=`` keyword as the stage planner takes it.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

import torch

from autoshard.lever_args import microbatch
from autoshard.passes.batch_coupling import batch_coupled_ops, describe_coupled
from autoshard.passes.errors import BatchCouplingWarning, BatchError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan, StagePlan
from autoshard.passes.solve.solution import Redistribution, Solution
from autoshard.passes.pipeline.stages.retrace import align_nodes, retrace_stage_nodes
from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes

__all__ = ["microbatch_plan", "warn_per_microbatch", "check_pipeline_inputs", "microbatch_inputs",
           "planner_stage_starts"]


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
    traced at the microbatch size: every node renamed to its counterpart (ops by ``retrace.align_nodes``,
    placeholders by position), the stage boundaries moved with them (``retrace.retrace_stage_nodes``),
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


def planner_stage_starts(captured: CapturedGraph, stages) -> Optional[list]:
    """``stages=`` as the stage planner takes them: unit indices and node names pass; module-name
    prefixes become the name of the first op they make. None stays None."""
    if stages is None:
        return None
    names = {n.name for n in captured.gm.graph.nodes if n.op == "call_function"}
    out = []
    for s in stages:
        if isinstance(s, int) or s in names:
            out.append(s)
        else:
            cut = stage_nodes_from_prefixes(captured, [str(s)])
            if len(cut) < 2:
                raise PlanFormatError(f"stage boundary {s!r} starts at the program's first op: stage 0 needs ops "
                                      "of its own; name where stages 1.. start")
            out.append(cut[1][0])
    return out
