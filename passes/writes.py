"""Which operands an op writes in place: its schema's write annotations, plus the composite ops
that update arguments in place without saying so (batch norm's running statistics in training);
and which parameters or buffers a program writes, directly or through aliases (``state_writes``).

The runtime's lowering gives such an op a private copy of a redistributed operand and moves the
update back to the operand's own placement afterwards (``runtime/lower.py``, ``write_backs``); the
cost model prices that move back (``passes.solve.lever_costs``). Both read the answer here.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.passes.graph import META, CapturedGraph, operands
from autoshard.passes.schema import bind_args, schema_of
from autoshard.passes.spec import TensorMeta

aten = torch.ops.aten

__all__ = ["written_operands", "aliases_first_operand", "state_writes", "ALIAS_OPS"]


# Composite ops that update arguments in place without saying so in their schema (training mode).
_IMPLICIT_WRITES = {
    aten.batch_norm.default: (("running_mean", "running_var"), "training"),
    aten.instance_norm.default: (("running_mean", "running_var"), "use_input_stats"),
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


#: Ops whose output aliases their first operand's storage (a write into the output is a write into it).
ALIAS_OPS = frozenset({
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.expand.default, aten.narrow.default, aten.view_as.default,
})


def state_writes(captured: CapturedGraph) -> list[tuple[fx.Node, str]]:
    """(writing node, parameter or buffer placeholder name) for every in-place write of ``captured`` into a
    parameter or buffer, directly or through a chain of aliases, in graph order."""
    state = set(captured.params) | set(captured.buffers)
    found = []
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        ops = operands(node)
        for i in written_operands(node):
            src = ops[i].node
            while isinstance(src, fx.Node) and src.op == "call_function" and src.args and aliases_first_operand(src):
                src = src.args[0]
            if isinstance(src, fx.Node) and src.op == "placeholder" and src.name in state:
                found.append((node, src.name))
    return found


def aliases_first_operand(node: fx.Node) -> bool:
    """Whether ``node``'s output is its first operand's storage: an alias op, or an in-place op that
    returns what it wrote (``avg.detach().mul_(0.9).add_(x)``: ``add_`` writes through ``mul_``)."""
    if node.target in ALIAS_OPS:
        return True
    schema = schema_of(node.target)
    return (schema is not None and len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            and schema.returns[0].alias_info.is_write and 0 in written_operands(node))
