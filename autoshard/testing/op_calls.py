"""Op calls: trace a tiny function and record the ATen calls it makes, to replay them one by one.

``trace_calls`` exports the function with ``torch.export`` (so arguments look exactly as in the
captured IR), gives every node ``node.meta["autoshard.meta"]`` and runs the graph once, recording
``{node: (args, kwargs)}``: clones of the real values each selected call saw. ``trace_op`` picks one
call out of that. The operand helpers walk a recorded call alongside its node's arguments: the
operands are the positions where the node has a tensor-valued node, in argument order (positional,
then keyword); ``operand_values`` lists them and ``substitute_operands`` puts other tensors in their
place, leaving every other argument as recorded.

May import: torch and ``autoshard.passes``; nothing else of ``autoshard.testing``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.passes.graph import META, is_getitem, tensor_meta_of
from autoshard.passes.spec import TensorMeta

__all__ = ["trace_calls", "record_calls", "trace_op", "clone_values", "map_operands", "substitute_operands",
           "operand_values", "output_tensors"]


def trace_calls(fn: Callable, args: Sequence, kwargs: Optional[dict] = None,
                select: Optional[Callable[[fx.Node], bool]] = None) -> tuple[fx.GraphModule, dict]:
    """Export ``fn(*args, **kwargs)``; return the graph and ``{node: (args, kwargs) it saw}``.

    Every tensor in ``args``/``kwargs`` becomes a graph input; tensors ``fn`` creates are lifted
    constants and fed back. Every node gets ``node.meta["autoshard.meta"]``. Recorded nodes: the
    call_function nodes (getitems excluded) for which ``select`` holds (default: all), in execution
    order, with clones of the values they saw when the program ran on ``args``.
    """
    kwargs = kwargs or {}
    flat, spec = tree_flatten((tuple(args), kwargs))
    tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    class Wrapper(torch.nn.Module):
        def forward(self, *tensors):
            vals = list(flat)
            for i, t in zip(tensor_pos, tensors):
                vals[i] = t
            a, k = tree_unflatten(vals, spec)
            return fn(*a, **k)

    inputs = iter(tuple(flat[i].clone() for i in tensor_pos))
    ep = torch.export.export(Wrapper(), tuple(flat[i].clone() for i in tensor_pos), strict=False)
    gm = ep.graph_module
    for n in gm.graph.nodes:
        n.meta[META] = tensor_meta_of(n.meta.get("val"))
    feed = [ep.constants[s.target] if s.kind.name == "CONSTANT_TENSOR" else next(inputs)
            for s in ep.graph_signature.input_specs]
    return gm, record_calls(gm, feed, select)


def record_calls(gm: fx.GraphModule, feed: Sequence, select: Optional[Callable[[fx.Node], bool]] = None) -> dict:
    """Run ``gm`` on ``feed``; ``{node: (args, kwargs)}`` (cloned) for each selected call_function node."""
    seen: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and not is_getitem(n) and (select is None or select(n)):
                a, k = self.fetch_args_kwargs_from_env(n)
                seen[n] = (clone_values(a), clone_values(k))
            return super().run_node(n)

    Recorder(gm, garbage_collect_values=False).run(*[t.clone() for t in feed])
    return seen


def trace_op(fn: Callable, args: Sequence, kwargs: Optional[dict] = None, target: Any = None):
    """``(node, real_args, real_kwargs)`` of the last op ``fn`` calls (the last call of ``target``)."""
    _, calls = trace_calls(fn, args, kwargs, None if target is None else (lambda n: n.target == target))
    if not calls:
        raise AssertionError(f"no call to {target or 'any op'} in the traced function")
    node = list(calls)[-1]
    return (node, *calls[node])


def clone_values(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(clone_values(x) for x in v) if isinstance(v, tuple) else [clone_values(x) for x in v]
    if isinstance(v, dict):
        return {k: clone_values(x) for k, x in v.items()}
    return v


def map_operands(node_arg, real, fn):
    """Replace each tensor operand of ``real`` (walked alongside the node's args) by ``fn(real)``."""
    if isinstance(node_arg, fx.Node):
        return fn(real) if isinstance(node_arg.meta.get(META), TensorMeta) else real
    if isinstance(node_arg, (list, tuple)):
        vals = [map_operands(a, r, fn) for a, r in zip(node_arg, real)]
        return tuple(vals) if isinstance(real, tuple) else vals
    if isinstance(node_arg, dict):
        return {k: map_operands(node_arg[k], real[k], fn) for k in node_arg}
    return real


def substitute_operands(node: fx.Node, args, kwargs, values: Sequence[torch.Tensor]):
    it = iter(values)
    a = map_operands(tuple(node.args), tuple(args), lambda _: next(it))
    k = map_operands(dict(node.kwargs), dict(kwargs), lambda _: next(it))
    return a, k


def operand_values(node: fx.Node, args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t):
        found.append(t)
        return t

    map_operands(tuple(node.args), tuple(args), collect)
    map_operands(dict(node.kwargs), dict(kwargs), collect)
    return found


def output_tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []
