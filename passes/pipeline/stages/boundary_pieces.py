"""What crosses a stage boundary on each rank: the producer's piece of the value.

A value sent from one stage to the next travels at its producer's planned placement, each rank's
own piece to the rank at the same coordinate of the next group (``runtime/pipeline/boundaries.py``
does it; ``layer_costs``' cut bytes price it). Pieces line up only between rank groups whose
submeshes have the same shape; a value read by a group of another shape travels full (``R``).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from autoshard.passes.layout.shapes import local_shape, normalize
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Replicate, Strategy, TensorMeta

__all__ = ["sent_placement", "sent_placements", "piece_bytes"]


def sent_placement(strategy: Optional[Strategy], producer: Mesh,
                   consumers: Sequence[Mesh]) -> tuple[Placement, ...]:
    """The placements a value travels at: its producer's (``strategy``'s first output, size-1 axes
    made ``R``), or ``R`` when it has no strategy or a consumer's submesh shape differs."""
    if strategy is None or any(tuple(c.shape) != tuple(producer.shape) for c in consumers):
        return normalize((Replicate(),) * producer.ndim, producer.shape)
    return normalize(strategy.outputs[0], producer.shape)


def sent_placements(graph, strategies: Mapping[str, Strategy],
                    meshes: Sequence[Mesh]) -> dict[str, tuple[Placement, ...]]:
    """Each value ``graph`` (a ``StageGraph``) sends -> ``sent_placement`` under its stage's
    ``strategies``; ``meshes[s]``: stage s's submesh."""
    mine = meshes[graph.index]
    return {name: sent_placement(strategies.get(name), mine, [meshes[c] for c in consumers])
            for name, consumers in graph.sends}


def piece_bytes(meta: TensorMeta, placements: Optional[Sequence[Placement]], mesh_shape: Sequence[int]) -> float:
    """Bytes of one rank's piece of a value of ``meta`` under ``placements`` (None: the whole value)."""
    if placements is None:
        return float(meta.nbytes)
    local = local_shape(meta.shape, normalize(placements, mesh_shape), mesh_shape, what="pipeline boundary value")
    return float(meta.nbytes) * math.prod(local) / max(1, math.prod(meta.shape))
