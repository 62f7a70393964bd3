"""A pipeline stage's whole-step memory peak per device, from its own plan's step walk.

A stage's intra-op plan (``plan_sharding`` of the stage's program at microbatch shapes) walks one
microbatch through the stage: forward, backward, optimizer step (``passes.solve.peak_timeline``;
``Solution.estimated_memory``). A pipeline step runs m microbatches through the stage under a
schedule. On top of one microbatch's walk, at the stage's peak (its backward):

- in-flight microbatches: the schedule holds ``held`` microbatches' saved activations on the stage
  (``Schedule.approx_held``), ``held - 1`` more than the walk's one;
- accumulated gradients: the stage's parameter gradients accumulate over the microbatches, so from
  the second microbatch on all of them are alive through its backward (the walk makes them as its
  backward goes: the gradients it already counts at its peak are counted twice, the safe side);
- point-to-point buffers (``p2p_bytes``): one microbatch's received activations and the gradients
  of the values it sends, which arrive from the next stage.

Measured against ``MemTracker`` on each stage rank by ``tests/runtime/pipeline/test_pipeline_memory_peak.py``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import TensorMeta
from autoshard.passes.graph import META

__all__ = ["stage_peak", "with_stage_peak", "stage_solution"]


def stage_peak(solution: Solution, held: int, p2p_bytes: float) -> float:
    """The stage's whole-step peak bytes per device (module docstring)."""
    saved = float(solution.estimated.get("saved_activation_bytes", solution.memory_breakdown.get("activations", 0.0)))
    grads = float(solution.memory_breakdown.get("grads", 0.0))
    return float(solution.estimated_memory) + max(0, int(held) - 1) * saved + grads + float(p2p_bytes)


def with_stage_peak(solution: Solution, held: int, p2p_bytes: float) -> Solution:
    """``solution`` with ``estimated_memory`` the stage's whole-step peak; one microbatch's walk stays
    in ``estimated["microbatch_peak_bytes"]`` and the terms added in ``estimated``."""
    estimated = dict(solution.estimated, microbatch_peak_bytes=float(solution.estimated_memory),
                     stage_held_microbatches=int(held), stage_p2p_bytes=float(p2p_bytes))
    return replace(solution, estimated_memory=stage_peak(solution, held, p2p_bytes), estimated=estimated)


def stage_solution(solution: Optional[Solution], graph: StageGraph, schedule: str, pp: int,
                   microbatches: int) -> Optional[Solution]:
    """A stage's intra-op ``solution`` (one microbatch's walk) with ``estimated_memory`` the stage's
    whole-step peak under ``schedule``: its in-flight microbatches (the schedule's closed form),
    accumulated gradients, and p2p buffers (the received values and the gradients of the sent ones,
    at full size: exact on a (1,) submesh, an over-estimate where the stage shards them)."""
    if solution is None:
        return solution
    from autoshard.passes.pipeline.schedule.registry import get_schedule
    held = get_schedule(schedule).approx_held(pp, microbatches)
    received = graph.captured.inputs[len(graph.captured.inputs) - len(graph.receives):] if graph.receives else []
    p2p = 0.0
    for name in list(received) + [n for n, _ in graph.sends]:
        meta = graph.captured.node(name).meta.get(META)
        p2p += meta.nbytes if isinstance(meta, TensorMeta) else 0.0
    return with_stage_peak(solution, held[min(graph.index, len(held) - 1)], p2p)
