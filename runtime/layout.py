"""One rank's piece of a whole tensor: ``shard_tensor`` narrows it to the piece the rank's mesh
coordinate holds. The arithmetic (local shapes and offsets under DTensor's left-to-right nesting)
is ``passes.layout.shapes``, which the planner uses too.
"""
from __future__ import annotations

from typing import Sequence

import torch

from autoshard.passes.layout.shapes import local_offsets, local_shape, normalize
from autoshard.passes.spec import Partial, Placement

__all__ = ["shard_tensor"]


def shard_tensor(full: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int],
                 coordinate: Sequence[int], *, partial: str = "keep") -> torch.Tensor:
    """The rank's piece of ``full`` (a view). ``partial``: on a ``P`` axis, "keep" the full value
    (any rank may hold it) or "first" (coordinate 0 holds it, the others zeros: a valid summand)."""
    placements = normalize(placements, mesh_shape)
    shape = local_shape(tuple(full.shape), placements, mesh_shape)
    offs = local_offsets(tuple(full.shape), placements, mesh_shape, coordinate)
    out = full
    for d, (o, n) in enumerate(zip(offs, shape)):
        if n != full.shape[d]:
            out = out.narrow(d, o, n)
    if partial == "first":
        if any(isinstance(p, Partial) and coordinate[a] != 0 for a, p in enumerate(placements)):
            out = torch.zeros_like(out)
    elif partial != "keep":
        raise ValueError(f"partial must be 'keep' or 'first', got {partial!r}")
    return out
