"""How a value crosses pipeline stages: at the placement its producer's plan gives it.

The stage planner prices a stage boundary at the bytes one device holds under the producer's
placement (``passes.pipeline.stages.layer_costs``: ``cut_batch`` / ``cut_fixed``), as Megatron-LM
sends it: each rank sends its own piece to the rank at the same submesh coordinate of the next
group (with sequence parallelism, the sequence-split residual stream; over data parallelism, its
own rows). ``boundary_placements`` gives every sent value that placement, so the program sends what
was priced: the sending program keeps the value as its plan placed it (a partial sum stays a
summand, as the plan prices it: the reduction is the receiving stage's), and the receiving program
takes the piece as an arrival (``lower(..., arrivals=)``), each reader redistributing from there.

Pieces line up only between rank groups whose submeshes have the same shape (the k-th rank of each
sits at the same coordinate); a value consumed by a group of another shape travels full (``R``)
and is chunked on arrival, for free.

Gradients go back on the same pairs and need nothing more: under the gradient convention
(``passes/spec.py``) the receiver's local gradient of an ``S`` piece is that piece of the true
gradient, of an ``R`` value a summand, of a ``P`` summand the whole gradient, and that is the seed
the sender's backward wants for an output so placed.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from autoshard.passes.pipeline.stages.boundary_pieces import sent_placements
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan
from autoshard.passes.spec import Placement, Strategy

__all__ = ["boundary_placements"]


def boundary_placements(plan: PipelinePlan, graphs: Sequence[StageGraph],
                        strategies: Mapping[int, Mapping[str, Strategy]]) -> dict[str, tuple[Placement, ...]]:
    """Sent value's node name -> the placements it travels at (``boundary_pieces.sent_placement``).
    ``strategies[s]``: stage s's strategies (``executor.stage_strategies``)."""
    meshes = [s.mesh for s in plan.stages]
    return {name: pls for g in graphs for name, pls in sent_placements(g, strategies[g.index], meshes).items()}
