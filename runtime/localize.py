"""Rewrite an op's non-tensor arguments for one rank: local sizes and the rank's device.

- Size arguments (the schema argument named ``size`` or ``shape``: view, reshape, _unsafe_view,
  expand, new_zeros/new_ones/new_empty/new_full, ...) of an op that reads tensors become the LOCAL
  output shape: the global shape from ``node.meta["autoshard.meta"]`` with each dim divided by the
  product of the mesh axes sharding it. Factory ops (no tensor operand) keep global sizes; the
  lowering chunks their output afterwards.
- Every ``torch.device`` argument (factories traced with ``device=meta``, ``_to_copy``) becomes the
  rank's device.

``written_operands`` says which operands an op updates in place (from its schema, plus the
composite ops whose schema does not say so, such as batch norm's running stats).

>>> local_size_args(aten.view.default, (x, [8, 6]), {}, (4, 6))
((x, [4, 6]), {})
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx as fx

from autoshard.passes.graph import META
from autoshard.passes.schema import bind_args, schema_of
from autoshard.passes.spec import TensorMeta

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


# Composite ops that update arguments in place without saying so in their schema (training mode).
_IMPLICIT_WRITES = {
    torch.ops.aten.batch_norm.default: (("running_mean", "running_var"), "training"),
    torch.ops.aten.instance_norm.default: (("running_mean", "running_var"), "use_input_stats"),
}


def _written_args(node: fx.Node) -> set:
    """(position, name) of every argument the op writes in place."""
    schema = schema_of(node.target)
    if schema is None:
        return set()
    written = {(i, a.name) for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write}
    if node.target in _IMPLICIT_WRITES:
        names, flag = _IMPLICIT_WRITES[node.target]
        if bind_args(node.target, node.args, node.kwargs)[flag]:
            pos = {a.name: i for i, a in enumerate(schema.arguments)}
            written |= {(pos[n], n) for n in names}
    return written


def written_operands(node: fx.Node) -> list[int]:
    """Indices (in ``passes.graph.operands`` order) of the tensor operands ``node`` writes in place."""
    written = _written_args(node)
    if not written:
        return []
    keys = {i for i, _ in written} | {name for _, name in written}
    origin: list = []  # the top-level argument (position or keyword) each operand comes from

    def visit(a, top):
        if isinstance(a, fx.Node):
            if isinstance(a.meta.get(META), TensorMeta):
                origin.append(top)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x, top)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x, top)

    for i, a in enumerate(node.args):
        visit(a, i)
    for k, v in node.kwargs.items():
        visit(v, k)
    return [i for i, top in enumerate(origin) if top in keys]
