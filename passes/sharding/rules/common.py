"""Helpers every rule family shares: dimension arguments, splittable dims, broadcasting.

>>> norm_dims([-1, 0], 3), split_dims((4, 1, 8))
([0, 2], [0, 2])
>>> broadcast_placement(TensorMeta((8,), torch.float32), out_dim=2, out_ndim=3)   # (8,) against (4, 6, 8)
Shard(dim=0)
"""
from __future__ import annotations

from typing import Any, Sequence

from autoshard.passes.spec import Placement, Replicate, Shard, TensorMeta

__all__ = ["norm_dim", "norm_dims", "split_dims", "broadcast_placement"]


def norm_dim(dim: int, ndim: int) -> int:
    """``-1`` -> ``ndim - 1``; a 0-dim tensor accepts dims -1 and 0 (as torch does)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % n


def norm_dims(dims: Any, ndim: int) -> list[int]:
    """A dim argument (int, list, None or ``[]``) as sorted non-negative dims; None/``[]``: all dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(int(d), ndim) for d in dims}) if ndim else []


def split_dims(shape: Sequence[int]) -> list[int]:
    """Dims worth splitting: size > 1 (a size-1 dim cannot be divided over 2+ ranks)."""
    return [d for d, s in enumerate(shape) if s > 1]


def broadcast_placement(meta: TensorMeta, out_dim: int, out_ndim: int) -> Placement:
    """Placement of an operand that broadcasts (right-aligned) to an ``out_ndim``-d result split on
    ``out_dim``: ``S`` on its matching dim, ``R`` where it lacks that dim or has size 1 there."""
    j = out_dim - (out_ndim - len(meta.shape))
    if j < 0 or meta.shape[j] == 1:
        return Replicate()
    return Shard(j)
