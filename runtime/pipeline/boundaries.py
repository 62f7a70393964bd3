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

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, CapturedGraph, operands
from autoshard.passes.layout.shapes import local_shape
from autoshard.passes.pipeline.stages.boundary_pieces import sent_placements
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from autoshard.passes.pipeline.plan import Plan
from autoshard.passes.spec import Placement, Strategy

from .p2p import Wiring

__all__ = ["boundary_placements", "stage_strategies", "wiring"]


def stage_strategies(graph: StageGraph, strategies: dict[str, Strategy]) -> dict[str, Strategy]:
    """The stage's strategies, completed for received values: a Solution planned on the whole program
    (the pipeline planner's, restricted to the stage) has none for them; each is placed as its first
    reader in the stage wants it (it arrives as ``boundary_placements`` says, and readers redistribute
    from there)."""
    out = dict(strategies)
    for name in graph.captured.inputs:
        if name in out:
            continue
        node = graph.captured.node(name)
        want = None
        for user in node.users:
            st = strategies.get(user.name)
            if st is None:
                continue
            for i, op in enumerate(operands(user)):
                if op.node is node:
                    want = tuple(st.inputs[i])
                    break
            if want is not None:
                break
        if want is None:
            raise PlanFormatError(f"stage {graph.index}: no strategy for received value {name!r} and no planned "
                                  "reader to take one from; plan the stage's sub-graph")
        out[name] = Strategy((), (want,))
    return out


def wiring(plan: Plan, graphs: Sequence[StageGraph], boundaries: Mapping[str, tuple],
           captured: CapturedGraph) -> Wiring:
    """Where each stage of ``plan`` lives and what flows between its ``graphs`` (``p2p.Wiring``): every
    sent value with its consumers, every received one, and its per-microbatch piece's shape and dtype
    at its boundary placement."""
    values, index = [], {}
    sends, receives = {}, {}
    for g in graphs:
        sends[g.index] = []
        for name, consumers in g.sends:
            index[name] = len(values)
            values.append((name, g.index))
            sends[g.index].append((index[name], consumers))
    for g in graphs:
        receives[g.index] = [index[name] for name, _ in g.receives]
    meta = []
    for name, producer in values:
        m = captured.node(name).meta[META]
        shape = local_shape(m.shape, boundaries[name], plan.stages[producer].mesh.shape,
                            what=f"pipeline boundary value {name!r}")
        meta.append((shape, m.dtype))
    ranks = {s.group: list(s.ranks) for s in plan.stages}
    return Wiring([s.group for s in plan.stages], ranks, values, sends, receives, meta, plan.microbatches)


def boundary_placements(plan: Plan, graphs: Sequence[StageGraph],
                        strategies: Mapping[int, Mapping[str, Strategy]]) -> dict[str, tuple[Placement, ...]]:
    """Sent value's node name -> the placements it travels at (``boundary_pieces.sent_placement``).
    ``strategies[s]``: stage s's strategies (``stage_strategies``)."""
    meshes = [s.mesh for s in plan.stages]
    return {name: pls for g in graphs for name, pls in sent_placements(g, strategies[g.index], meshes).items()}
