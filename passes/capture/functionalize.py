"""Writes through views of intermediate values become functional scatters.

``key = k.new_empty(...); key[..., :d] = k_pass; key[..., d:] = k_rot`` (DeepSeek's attention)
exports as ``copy_`` ops writing into ``slice`` views of ``new_empty``. The write reaches the base
only because, on one device, the slice shares the base's storage. Sharded, a rank's slice is a view
of the base's local piece only when no redistribution sits between them, so a plan may silently
lose the write. This pass makes the dataflow explicit, as torch's functionalization does::

    slice_8 = slice(new_empty, 3, 0, 8); copy_(slice_8, k_pass)
    ->  copy = copy(slice(new_empty, 3, 0, 8), k_pass); new_empty_1 = slice_scatter(new_empty, copy, 3, 0, 8)

and every later reader of ``new_empty`` (or of a view of it taken before the write) reads the new
version. Only writes through chains of these views are rewritten: ``slice``, ``select``, the
reshape-like views (``view``, ``_unsafe_view``, ``reshape``, ``flatten``, ``unflatten``,
``unsqueeze``, ``squeeze``, ``alias``), ``transpose`` and ``permute``, rooted at an op's output.
Writes into a base directly (``x.add_(y)``), and writes into views of parameters, buffers or
inputs, stay in place (the runtime writes them back into the stored piece).

Works on an exported graph before annotation: every node it makes gets ``meta["val"]`` (a meta
tensor) and the written node's ``nn_module_stack``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from autoshard.passes.schema import bind_args, schema_of

__all__ = ["functionalize_view_writes"]

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
             aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten.alias.default}
_VIEWS = _RESHAPES | {aten.slice.Tensor, aten.select.int, aten.transpose.int, aten.permute.default}


def _is_view(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VIEWS


def _written_self(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place op writing its first argument (``add_``, ``copy_``, ...)."""
    schema = schema_of(node.target)
    if schema is None or not schema.arguments or not node.args:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write and isinstance(node.args[0], fx.Node)


def _functional(target):
    """The out-of-place twin of an in-place overload (``add_.Tensor`` -> ``add.Tensor``), or None
    (``copy_`` is handled apart: ``aten.copy`` has no derivative)."""
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _meta_val(target, args, kwargs):
    def meta(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
        return a
    return target(*fx.node.map_aggregate(args, meta), **fx.node.map_aggregate(kwargs, meta))


class _Rewriter:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.current: dict[fx.Node, fx.Node] = {}  # root -> its latest version
        self.origin: dict[fx.Node, fx.Node] = {}  # a version -> the root it is a version of
        self.made: set[fx.Node] = set()

    def node(self, target, args, kwargs, like: fx.Node) -> fx.Node:
        n = self.graph.call_function(target, args, kwargs)
        n.meta["val"] = _meta_val(target, args, kwargs)
        for key in ("nn_module_stack", "stack_trace"):
            if key in like.meta:
                n.meta[key] = like.meta[key]
        self.made.add(n)
        return n

    def chain(self, view: fx.Node) -> Optional[tuple[fx.Node, list[fx.Node]]]:
        """(root, [view ops from the root down to ``view``]) when ``view`` is a view chain of an op's output."""
        ops = []
        while _is_view(view):
            ops.append(view)
            view = view.args[0]
        if not ops or not isinstance(view, fx.Node) or view.op != "call_function":
            return None
        return view, ops[::-1]

    def replay(self, base: fx.Node, ops: list[fx.Node], like: fx.Node) -> list[fx.Node]:
        """The views ``ops`` taken again on ``base``: [base, view 1, ..., view k]."""
        found = [base]
        for op in ops:
            found.append(self.node(op.target, (found[-1],) + tuple(op.args[1:]), dict(op.kwargs), like))
        return found

    def scatter(self, op: fx.Node, parent: fx.Node, value: fx.Node, like: fx.Node) -> fx.Node:
        """``parent`` with the part ``op`` views replaced by ``value``."""
        t = op.target
        if t is aten.slice.Tensor:
            b = bind_args(t, op.args, op.kwargs)
            return self.node(aten.slice_scatter.default, (parent, value, b["dim"], b["start"], b["end"], b["step"]),
                             {}, like)
        if t is aten.select.int:
            b = bind_args(t, op.args, op.kwargs)
            return self.node(aten.select_scatter.default, (parent, value, b["dim"], b["index"]), {}, like)
        if t is aten.transpose.int:
            return self.node(t, (value,) + tuple(op.args[1:]), {}, like)
        if t is aten.permute.default:
            dims = [int(d) % len(op.args[1]) for d in op.args[1]]
            inverse = sorted(range(len(dims)), key=lambda i: dims[i])
            return self.node(t, (value, inverse), {}, like)
        return self.node(aten.reshape.default, (value, list(parent.meta["val"].shape)), {}, like)

    def copied(self, view: fx.Node, src: fx.Node, like: fx.Node) -> fx.Node:
        """What ``view.copy_(src)`` leaves in ``view``: ``src`` cast to its dtype, broadcast to its shape."""
        want = view.meta["val"]
        if src.meta["val"].dtype != want.dtype:
            src = self.node(aten._to_copy.default, (src,), {"dtype": want.dtype}, like)
        if tuple(src.meta["val"].shape) != tuple(want.shape):
            src = self.node(aten.expand.default, (src, list(want.shape)), {}, like)
        return src

    def rewrite_write(self, node: fx.Node, root: fx.Node, ops: list[fx.Node]) -> None:
        is_copy = node.target is aten.copy_.default and isinstance(node.args[1], fx.Node)
        functional = None if is_copy else _functional(node.target)
        if functional is None and not is_copy:
            return
        root = self.origin.get(root, root)
        with self.graph.inserting_before(node):
            views = self.replay(self.current.get(root, root), ops, node)
            if is_copy:
                value = self.copied(views[-1], node.args[1], node)
            else:
                value = self.node(functional, (views[-1],) + tuple(node.args[1:]), dict(node.kwargs), node)
            for op, parent in zip(reversed(ops), reversed(views[:-1])):
                value = self.scatter(op, parent, value, node)
            self.current[root] = value
            self.origin[value] = root
            written = self.replay(value, ops, node)[-1]
        node.replace_all_uses_with(written)
        self.graph.erase_node(node)

    def refresh_reads(self, node: fx.Node) -> None:
        """Point ``node``'s reads of a rewritten root, or of a view of one taken before its last write,
        at the root's latest version."""
        def fresh(a):
            if not isinstance(a, fx.Node) or a in self.made:
                return a
            if a in self.current:
                return self.current[a]
            found = self.chain(a) if _is_view(a) else None
            if found is not None and found[0] in self.current:
                with self.graph.inserting_before(node):
                    return self.replay(self.current[found[0]], found[1], node)[-1]
            return a
        node.args = fx.node.map_aggregate(node.args, fresh)
        node.kwargs = fx.node.map_aggregate(node.kwargs, fresh)

    def run(self) -> bool:
        for node in list(self.graph.nodes):
            if node.op not in ("call_function", "output") or node in self.made:
                continue
            self.refresh_reads(node)
            if node.op == "call_function" and _written_self(node) and _is_view(node.args[0]):
                found = self.chain(node.args[0])
                if found is not None:
                    self.rewrite_write(node, *found)
        return bool(self.current)


def functionalize_view_writes(graph: fx.Graph) -> bool:
    """Rewrite in-place writes through views of op outputs as functional scatters (module docstring).
    Returns whether anything was rewritten; views left without users are removed."""
    changed = _Rewriter(graph).run()
    if changed:
        for node in reversed(list(graph.nodes)):
            if _is_view(node) and not node.users:
                graph.erase_node(node)
    return changed
