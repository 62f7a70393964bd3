"""The front door's pipeline helpers, used by the driver (``autoshard.driver``). Moving a plan onto the
program traced at the microbatch size is ``passes.pipeline.stages.retrace``'s.

- ``warn_per_microbatch``: the batch-coupled ops a pipeline runs per microbatch;
- ``check_pipeline_inputs``: what inputs a pipeline can cut;
- ``planner_stage_starts``: the ``stages=`` keyword as the stage planner takes it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from autoshard.lever_args import microbatch
from autoshard.passes.batch_coupling import batch_coupled_ops, describe_coupled
from autoshard.passes.errors import BatchCouplingWarning, BatchError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes

__all__ = ["warn_per_microbatch", "check_pipeline_inputs", "microbatch_inputs",
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
