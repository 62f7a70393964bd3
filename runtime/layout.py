"""Where each rank's piece of a placed tensor lies inside the global tensor.

Placements follow DTensor's left-to-right nesting: when several mesh axes shard the same dim,
the first of them splits the dim into equal chunks, the next splits each chunk again, and so on.
Shards are always even (the planner filters out strategies that do not divide).

>>> from autoshard.passes.spec import S, R
>>> local_shape((8, 6), (S(0), S(0)), (2, 2))
(2, 6)
>>> local_offsets((8, 6), (S(0), S(0)), (2, 2), (1, 0))
(4, 0)
"""
from __future__ import annotations

from typing import Sequence, Type

import torch

from autoshard.passes.errors import AutoshardError, PlanFormatError
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, fmt_placements


def normalize(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[Placement, ...]:
    """Placements with every size-1 axis made ``R`` (on such an axis S, R and P all mean the same)."""
    if len(placements) != len(mesh_shape):
        raise PlanFormatError(
            f"placements {fmt_placements(placements)} have {len(placements)} entries but the mesh "
            f"{tuple(mesh_shape)} has {len(mesh_shape)} axes"
        )
    return tuple(Replicate() if n == 1 else p for p, n in zip(placements, mesh_shape))


def sharding_axes(placements: Sequence[Placement], ndim: int) -> list[list[int]]:
    """For each tensor dim, the mesh axes sharding it, in nesting (axis) order."""
    axes: list[list[int]] = [[] for _ in range(ndim)]
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % ndim if ndim else p.dim
            if ndim == 0 or not 0 <= d < ndim:
                raise PlanFormatError(f"placement S({p.dim}) on a tensor with {ndim} dims")
            axes[d].append(a)
    return axes


def local_shape(global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                *, error: Type[AutoshardError] = PlanFormatError, what: str = "tensor") -> tuple[int, ...]:
    """The shape of one rank's piece; raises ``error`` (showing the arithmetic) on uneven shards."""
    shape = list(global_shape)
    for d, axes in enumerate(sharding_axes(placements, len(shape))):
        if not axes:
            continue
        ways = 1
        for a in axes:
            ways *= mesh_shape[a]
        if shape[d] % ways:
            names = " x ".join(f"axis {a} ({mesh_shape[a]})" for a in axes)
            raise error(
                f"{what} of shape {tuple(global_shape)} is sharded on dim {d} over {names} = {ways} ways, "
                f"but {shape[d]} % {ways} = {shape[d] % ways}; use a size divisible by {ways} or another plan"
            )
        shape[d] //= ways
    return tuple(shape)


def local_offsets(global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                  coordinate: Sequence[int]) -> tuple[int, ...]:
    """Start index of the rank's piece along each dim (shards assumed even)."""
    offsets = []
    for d, axes in enumerate(sharding_axes(placements, len(global_shape))):
        size, off = global_shape[d], 0
        for a in axes:
            size //= mesh_shape[a]
            off += coordinate[a] * size
        offsets.append(off)
    return tuple(offsets)


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
