"""Where each rank's piece of a placed tensor lies inside the global tensor, and whether it divides.

Placements follow DTensor's left-to-right nesting: when several mesh axes shard the same dim, the
first of them splits the dim into equal chunks, the next splits each chunk again, and so on. Shards
are always even (the planner keeps only strategies whose placements divide every shape).

>>> from autoshard.passes.spec import S, R
>>> local_shape((8, 6), (S(0), S(0)), (2, 2))
(2, 6)
>>> local_offsets((8, 6), (S(0), S(0)), (2, 2), (1, 0))
(4, 0)
>>> why_not_divisible((6, 4), (S(0),), Mesh.of((4,)))
"dim 0 of size 6 does not divide over axis 'x' of size 4"
"""
from __future__ import annotations

from typing import Optional, Sequence, Type

from autoshard.passes.errors import AutoshardError, PlanFormatError
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Replicate, Shard, fmt_placements

__all__ = ["normalize", "sharding_axes", "local_shape", "local_offsets", "why_not_divisible", "divides"]


def normalize(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[Placement, ...]:
    """Placements with every size-1 axis made ``R`` (on such an axis S, R and P all mean the same)."""
    if len(placements) != len(mesh_shape):
        raise PlanFormatError(
            f"placements {fmt_placements(placements)} have {len(placements)} entries but the mesh "
            f"{tuple(mesh_shape)} has {len(mesh_shape)} axes"
        )
    return tuple(Replicate() if n == 1 else p for p, n in zip(placements, mesh_shape))


def sharding_axes(placements: Sequence[Placement], ndim: int) -> list[list[int]]:
    """For each tensor dim, the mesh axes sharding it, in nesting (axis) order; a negative ``S(d)``
    counts from the last dim."""
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
    """Start index of the piece of the rank at mesh ``coordinate`` along each dim (shards even)."""
    offsets = []
    for d, axes in enumerate(sharding_axes(placements, len(global_shape))):
        size, off = global_shape[d], 0
        for a in axes:
            size //= mesh_shape[a]
            off += coordinate[a] * size
        offsets.append(off)
    return tuple(offsets)


def why_not_divisible(shape: Sequence[int], pls: Sequence[Placement], mesh: Mesh) -> Optional[str]:
    """None if ``pls`` splits ``shape`` evenly over ``mesh``, else the reason in words."""
    per_dim: dict[int, list[int]] = {}
    for a, p in enumerate(pls):
        if isinstance(p, Shard):
            if not 0 <= p.dim < len(shape):
                return f"S({p.dim}) on axis {mesh.axis_names[a]!r} names a dim the {len(shape)}-d tensor lacks"
            per_dim.setdefault(p.dim, []).append(a)
    for d, axes in per_dim.items():
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        if shape[d] % n:
            names = " x ".join(f"{mesh.axis_names[a]!r} of size {mesh.shape[a]}" for a in axes)
            return f"dim {d} of size {shape[d]} does not divide over axis {names}"
    return None


def divides(shape: Sequence[int], pls: Sequence[Placement], mesh: Mesh) -> bool:
    return why_not_divisible(shape, pls, mesh) is None
