"""Enumerate the multi-axis strategies of every node: the product over mesh axes of 1-D options.

For a call_function node the rule registry gives 1-D options (``Strategy1D``) valid along one axis
of any size; a mesh strategy picks one per axis of size > 1 (axes of size 1 only take the
all-replicated option) and is kept only if every operand and output divides: a tensor dim
sharded on a set of axes must be divisible by the product of those axes' sizes, and the rule's
``LocalCheck``, if it registered one, accepts the local shapes (a kernel's alignment, say). Placeholders
(parameters, buffers, inputs, target) get one output placement per axis, ``R`` or ``S(d)``: for a
parameter that is its storage placement (S = FSDP/ZeRO-3 shard, R = replicated with the gradient
all-reduced), for an input the chunk each rank takes of the global batch it receives.

>>> table = enumerate_strategies(captured, Mesh.of((2, 2)))     # doctest: +SKIP
>>> [str(s) for s in table["p_fc1_weight"]][:3]                 # doctest: +SKIP
['[]->[(R, R)]', '[]->[(R, S(0))]', '[]->[(R, S(1))]']

Identical ops (same target, arguments and shapes) share one enumeration, so a 32-layer model costs
about as much as one layer. Each node keeps at most ``max_per_node`` strategies (duplicates by
placements dropped; when the product is larger, the ones that split the most work are kept, and
the all-replicated strategy always).
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import torch.fx as fx

from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.layout.shapes import divides, local_shape, why_not_divisible
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.rules import local_check, op_call, rule_strategies
from autoshard.passes.sharding.storage_forms import form_variants
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy, Strategy1D, TensorMeta

__all__ = ["StrategyTable", "enumerate_strategies", "unruled_ops", "divides", "why_not_divisible", "local_shape",
           "placeholder_strategies", "parameter_strategies", "DEFAULT_MAX_PER_NODE"]

DEFAULT_MAX_PER_NODE = 256


class StrategyTable(dict):
    """``node name -> list[Strategy]`` (placeholders and call_function nodes), all-replicated first.

    ``unruled`` maps each call_function node that had no sharding rule to its op name (those nodes
    only have the all-replicated strategy).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unruled: dict[str, str] = {}


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in x.items())))
    if isinstance(x, fx.Node):
        return ("node", x.name)
    try:
        hash(x)
        return x
    except TypeError:
        return ("repr", repr(x))


def _strategy_ok(s: Strategy, in_metas, out_metas, mesh: Mesh) -> bool:
    for metas, pls_list in ((in_metas, s.inputs), (out_metas, s.outputs)):
        for m, pls in zip(metas, pls_list):
            if not divides(m.shape, pls, mesh):
                return False
    return True


def _combine(options: list[Strategy1D], mesh: Mesh, in_metas, out_metas, cap: int, check=None) -> list[Strategy]:
    """The mesh strategies of a node from its 1-D options; ``check(local_in_shapes, local_out_shapes)``:
    the rule's ``LocalCheck`` (None: none)."""
    replicated = options[0]
    per_axis = [options if size > 1 else [replicated] for size in mesh.shape]
    found: list[Strategy] = []
    seen: set = set()
    for combo in itertools.product(*per_axis):
        ins = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(in_metas)))
        outs = tuple(tuple(c.outputs[j] for c in combo) for j in range(len(out_metas)))
        if (ins, outs) in seen:
            continue
        s = Strategy(ins, outs, tuple(c.lowering for c in combo))
        if _strategy_ok(s, in_metas, out_metas, mesh) and (check is None or check(
                [local_shape(m.shape, p, mesh.shape) for m, p in zip(in_metas, ins)],
                [local_shape(m.shape, p, mesh.shape) for m, p in zip(out_metas, outs)])):
            seen.add((ins, outs))
            found.append(s)
    return _cap(found, mesh, cap)


def _cap(found: list[Strategy], mesh: Mesh, cap: int) -> list[Strategy]:
    if len(found) <= cap:
        return found

    def rank(item):
        i, s = item
        pls = [p for t in (*s.inputs, *s.outputs) for p in t]
        split = 1
        for a, size in enumerate(mesh.shape):
            if any(not isinstance(t[a], Replicate) for t in (*s.inputs, *s.outputs)):
                split *= size
        return (-split, sum(isinstance(p, Partial) for p in pls), i)

    kept = sorted(enumerate(found[1:], start=1), key=rank)[: cap - 1]
    return [found[0]] + [s for _, s in sorted(kept, key=lambda t: t[0])]


def placeholder_strategies(meta: Optional[TensorMeta], mesh: Mesh, cap: int = DEFAULT_MAX_PER_NODE) -> list[Strategy]:
    """R or S(d) per mesh axis for a placeholder tensor, all-R first."""
    none = tuple(None for _ in mesh.shape)
    if not isinstance(meta, TensorMeta):
        return [Strategy((), (), none)]
    per_axis = [[Replicate()] + ([Shard(d) for d in range(len(meta.shape))] if size > 1 else [])
                for size in mesh.shape]
    found = [Strategy((), (tuple(c),), none) for c in itertools.product(*per_axis)
             if divides(meta.shape, c, mesh)]
    return _cap(found, mesh, cap)


def parameter_strategies(meta: TensorMeta, mesh: Mesh, cap: int = DEFAULT_MAX_PER_NODE) -> list[Strategy]:
    """A trained parameter's strategies: ``placeholder_strategies`` (the plain forms, in their order),
    then every other storage form of each (``storage_forms.form_variants``: ZeRO-1/2 over its
    replicated axes, reduction once per step), at most ``cap`` in all."""
    plain = placeholder_strategies(meta, mesh, cap)
    found = list(plain)
    for s in plain:
        for lowerings in form_variants(meta.shape, s.outputs[0], mesh.shape)[1:]:
            found.append(Strategy((), s.outputs, lowerings))
    return found[:max(cap, len(plain))]


def enumerate_strategies(captured: CapturedGraph, mesh: Mesh, *, max_per_node: int = DEFAULT_MAX_PER_NODE,
                         storage_forms: bool = False) -> StrategyTable:
    """Strategies for every placeholder and call_function node of ``captured`` on ``mesh``.
    ``storage_forms``: a trained program's parameters also get their other storage forms
    (``parameter_strategies``), after the plain ones."""
    mesh = Mesh.of(mesh)
    if max_per_node < 1:
        raise ValueError(f"max_per_node must be >= 1, got {max_per_node}")
    table = StrategyTable()
    cache: dict = {}
    forms = storage_forms and captured.training
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            meta = node.meta.get(META)
            param = forms and node.name in captured.params and isinstance(meta, TensorMeta)
            key = ("parameter" if param else "placeholder", meta)
            if key not in cache:
                cache[key] = (parameter_strategies(meta, mesh, max_per_node) if param
                              else placeholder_strategies(meta, mesh, max_per_node), True)
            table[node.name] = list(cache[key][0])
        elif node.op == "call_function":
            call = op_call(node)
            key = (node.target, _freeze(call.args), _freeze(call.kwargs), call.inputs, call.outputs)
            if key not in cache:
                try:
                    options, has_rule = rule_strategies(node)
                except Exception as e:  # a rule bug: say which node and op it hit
                    raise RuntimeError(f"the sharding rule for {node.target} failed on node {node.name!r} "
                                       f"(inputs {[m.shape for m in call.inputs]}): {e}") from e
                check = local_check(node.target)
                bound = None if check is None else (lambda ins, outs, call=call, check=check: check(call, ins, outs))
                cache[key] = (_combine(options, mesh, call.inputs, call.outputs, max_per_node, bound), has_rule)
            strategies, has_rule = cache[key]
            table[node.name] = list(strategies)
            if not has_rule:
                table.unruled[node.name] = str(node.target)
    return table


def unruled_ops(captured: CapturedGraph) -> dict[str, str]:
    """``node name -> op name`` for every call_function node whose op has no sharding rule."""
    has: dict = {}
    found: dict[str, str] = {}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target not in has:
            has[node.target] = rule_strategies(node)[1]
        if not has[node.target]:
            found[node.name] = str(node.target)
    return found
