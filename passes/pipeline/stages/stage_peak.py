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
  of the values it sends, which arrive from the next stage (each rank's piece: ``boundary_pieces``).

The optimizer step runs after the last microbatch, when none of these are alive: its peak is the
walk's. The stage planner's ILP constrains the same peak per layer unit (``stage_ilp`` (3')), so the
cut it picks is one every stage's own plan fits.

A rank group holding several stages (virtual stages) is not priced at the sum of these peaks: its
stages run one at a time, so ``stage_memory_record`` splits each stage's peak into what it keeps and
what running adds, and ``passes.pipeline.group_peak`` takes the group's peak over the schedule's moments.

Measured against ``MemTracker`` on each stage rank (and, interleaved, each rank group) by
``tests/runtime/pipeline/test_pipeline_memory_peak.py``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autoshard.passes.pipeline.group_peak import memory_record
from autoshard.passes.pipeline.stages.boundary_pieces import piece_bytes
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import TensorMeta
from autoshard.passes.graph import META

__all__ = ["stage_peak", "with_stage_peak", "stage_solution", "stage_memory_record"]


def stage_peak(solution: Solution, held: int, p2p_bytes: float, *, recompute: bool = False,
               received_bytes: float = 0.0) -> float:
    """The stage's whole-step peak bytes per device (module docstring): the larger of the step's
    forward / backward peak with the other in-flight microbatches, the accumulated gradients and the
    p2p buffers added, and the optimizer step's peak (after the last microbatch: none of those alive).
    A recomputing stage (``recompute``) keeps only its ``received_bytes`` for the other microbatches."""
    estimated = solution.estimated
    saved = float(estimated.get("saved_activation_bytes", solution.memory_breakdown.get("activations", 0.0)))
    grads = float(solution.memory_breakdown.get("grads", 0.0))
    per_microbatch = float(received_bytes) if recompute else saved
    added = max(0, int(held) - 1) * per_microbatch + grads + float(p2p_bytes)
    if "peak_backward_bytes" not in estimated:  # a solution without its phases: all of it, the safe side
        return float(solution.estimated_memory) + added
    in_step = max(float(estimated.get("peak_forward_bytes", 0.0)), float(estimated["peak_backward_bytes"]))
    return max(in_step + added, float(estimated.get("peak_optimizer_step_bytes", 0.0)))


def with_stage_peak(solution: Solution, held: int, p2p_bytes: float, *, recompute: bool = False,
                    received_bytes: float = 0.0, microbatches: int = 0) -> Solution:
    """``solution`` with ``estimated_memory`` the stage's whole-step peak; one microbatch's walk stays
    in ``estimated["microbatch_peak_bytes"]`` and the terms added in ``estimated``, with the stage's
    terms of its group's peak (``stage_memory_record``) when ``microbatches`` (per step) is given."""
    estimated = dict(solution.estimated, microbatch_peak_bytes=float(solution.estimated_memory),
                     stage_held_microbatches=int(held), stage_p2p_bytes=float(p2p_bytes))
    if microbatches:
        estimated.update(stage_memory_record(solution, p2p_bytes, microbatches, recompute=recompute,
                                             received_bytes=received_bytes))
    peak = stage_peak(solution, held, p2p_bytes, recompute=recompute, received_bytes=received_bytes)
    return replace(solution, estimated_memory=peak, estimated=estimated)


def stage_memory_record(solution: Solution, p2p_bytes: float, microbatches: int, *, recompute: bool = False,
                        received_bytes: float = 0.0) -> dict:
    """The stage's terms of its rank group's peak (``group_peak.memory_record``), from the same walk
    as ``stage_peak``: idle, what the whole walk keeps (``step_resident_bytes``) with the accumulated
    gradients and the p2p buffers; per held microbatch, its saved activations (a recomputing stage: its
    received values); running, the rest of the walk's in-step peak over those. With ``held`` microbatches
    held, idle + held x per microbatch + running is ``stage_peak``'s in-step peak, but for the p2p
    buffers: the runtime keeps every tensor it sends until the step's last send is done
    (``runtime.pipeline.p2p.Transport.drain``), so by the step's end a stage holds what it sent for all
    ``microbatches`` (its outputs and its inputs' gradients), with one microbatch's receives posted.
    Measured (``tests/runtime/pipeline/test_pipeline_memory_peak.py``, interleaved, 2 ranks): counting
    them once left the group 6.2% under. Empty for a solution without its phases (the group then sums
    the stages' peaks, the safe side)."""
    estimated = solution.estimated
    if "peak_backward_bytes" not in estimated or "step_resident_bytes" not in estimated:
        return {}
    saved = float(estimated.get("saved_activation_bytes", solution.memory_breakdown.get("activations", 0.0)))
    grads = float(solution.memory_breakdown.get("grads", 0.0))
    per_microbatch = float(received_bytes) if recompute else saved
    resident = float(estimated["step_resident_bytes"])
    in_step = max(float(estimated.get("peak_forward_bytes", 0.0)), float(estimated["peak_backward_bytes"]))
    running = in_step - resident - per_microbatch
    return memory_record(resident + grads + (int(microbatches) + 1) * float(p2p_bytes), per_microbatch, running,
                         float(estimated.get("peak_optimizer_step_bytes", 0.0)))


def stage_solution(solution: Optional[Solution], graph: StageGraph, schedule: str, pp: int,
                   microbatches: int, recompute: bool = False,
                   arrivals: Optional[dict] = None) -> Optional[Solution]:
    """A stage's intra-op ``solution`` (one microbatch's walk) with ``estimated_memory`` the stage's
    whole-step peak under ``schedule``: its in-flight microbatches (the schedule's closed form; only
    their received values when the stage ``recompute``s), accumulated gradients, and p2p buffers:
    the received values and the gradients of the sent ones, each the piece one rank holds
    (``boundary_pieces``): a sent value at ``solution``'s placement, a received one at ``arrivals``'
    (received name -> placements; absent: the whole value)."""
    if solution is None:
        return solution
    from autoshard.passes.pipeline.schedule.registry import get_schedule
    held = get_schedule(schedule).approx_held(pp, microbatches)
    shape = solution.mesh.shape

    def nbytes(names, placements) -> float:
        metas = [(graph.captured.node(n).meta.get(META), placements(n)) for n in names]
        return float(sum(piece_bytes(m, p, shape) for m, p in metas if isinstance(m, TensorMeta)))

    def sent_at(name):
        st = solution.strategies.get(name)
        return st.outputs[0] if st is not None else None

    received = graph.captured.inputs[len(graph.captured.inputs) - len(graph.receives):] if graph.receives else []
    got = nbytes(received, lambda n: (arrivals or {}).get(n))
    sent = nbytes([n for n, _ in graph.sends], sent_at)
    return with_stage_peak(solution, held[min(graph.index, len(held) - 1)], got + sent, recompute=recompute,
                           received_bytes=got, microbatches=microbatches)
