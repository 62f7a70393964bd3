"""Rewrite an op's non-tensor arguments for one rank: local sizes and the rank's device.

- Size arguments (the schema argument named ``size`` or ``shape``: view, reshape, _unsafe_view,
  expand, new_zeros/new_ones/new_empty/new_full, ...) of an op that reads tensors become the LOCAL
  output shape: the global shape from ``node.meta["autoshard.meta"]`` with each dim divided by the
  product of the mesh axes sharding it. Factory ops (no tensor operand) keep global sizes; the
  lowering chunks their output afterwards.
- Every ``torch.device`` argument (factories traced with ``device=meta``, ``_to_copy``) becomes the
  rank's device.

``written_operands`` (which operands an op updates in place) lives in ``passes.writes``, which
the cost model reads too; it is re-exported here.

>>> local_size_args(aten.view.default, (x, [8, 6]), {}, (4, 6))
((x, [4, 6]), {})
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from autoshard.passes.schema import schema_of
from autoshard.passes.writes import written_operands

__all__ = ["size_arg", "local_size_args", "rewrite_devices", "written_operands"]

_SIZE_NAMES = ("size", "shape")


def size_arg(target) -> Optional[tuple[int, str]]:
    """(position, name) of the op's size-like list argument, or None."""
    schema = schema_of(target)
    if schema is None:
        return None
    for i, a in enumerate(schema.arguments):
        if a.name in _SIZE_NAMES and isinstance(a.type, torch.ListType):
            return i, a.name
    return None


def local_size_args(target, args: tuple, kwargs: dict, local_out_shape: Sequence[int]) -> tuple[tuple, dict]:
    """Replace the size argument with ``local_out_shape`` (unchanged if the op has none)."""
    found = size_arg(target)
    if found is None:
        return args, kwargs
    pos, name = found
    shape = [int(s) for s in local_out_shape]
    if pos < len(args):
        args = args[:pos] + (shape,) + args[pos + 1:]
    elif name in kwargs:
        kwargs = {**kwargs, name: shape}
    return args, kwargs


def rewrite_devices(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Every ``torch.device`` value (and any ``device=`` keyword) becomes ``device``."""
    def sub(a):
        if isinstance(a, torch.device):
            return device
        if isinstance(a, (list, tuple)) and not isinstance(a, fx.Node):
            return type(a)(sub(x) for x in a)
        return a

    new_kwargs = {k: (device if k == "device" and v is not None else sub(v)) for k, v in kwargs.items()}
    return tuple(sub(a) for a in args), new_kwargs


