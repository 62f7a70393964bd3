"""Which operands an op writes in place: its schema's write annotations, plus the composite ops
that update arguments in place without saying so (batch norm's running statistics in training).

The runtime's lowering gives such an op a private copy of a redistributed operand and moves the
update back to the operand's own placement afterwards (``runtime/lower.py``, ``write_backs``); the
cost model prices that move back (``passes.solve.lever_costs``). Both read the answer here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.graph import META
from autoshard.passes.schema import bind_args, schema_of
from autoshard.passes.spec import TensorMeta

__all__ = ["written_operands"]


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
