"""Normalization of an exported program into the contract of ``passes.graph.CapturedGraph``.

``capture`` (``passes/capture/export.py``) exports a wrapper module whose ``PROGRAM_MODEL_ATTR``
attribute holds the user's model; ``normalize_export`` turns that export into the captured graph:

- placeholders, in order: parameters (``model.named_parameters()`` order), buffers
  (``model.named_buffers()`` order, non-persistent ones included), user inputs, then the target.
  So ``gm(*model.parameters(), *model.buffers(), *inputs[, target])`` runs the program.
- tied tensors get ONE placeholder under the canonical FQN (first name in
  ``named_parameters(remove_duplicate=False)`` order); the other names go to ``aliases``.
  Parameters the program never reads keep their placeholder (no users), so gradients and the
  optimizer still see them.
- output: the node itself when the program returns one value (``loss_output``: a scalar loss),
  a tuple of nodes when it returns several.
- every node carries ``autoshard.meta`` and ``autoshard.module`` (paths as in
  ``model.named_modules()``, without the wrapper's prefix); nodes whose arguments hold a
  ``torch.device`` carry ``DEVICE_KWARG = True`` (``set_graph_device`` retargets them).
- ``aten._assert_tensor_metadata`` checks are dropped, and tensor constants become ``get_attr``
  nodes of buffers on the returned GraphModule.
- in-place writes through views of intermediate values (``key[..., :d] = k_pass``) become
  functional scatters (``passes.capture.functionalize``), so no plan can lose them.

Export's parameter, buffer and constant FQNs carry the wrapper's prefix (``model.fc1.weight``);
``_strip`` removes it so every name is the user's (``fc1.weight``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind

from autoshard.passes.capture.functionalize import functionalize_view_writes
from autoshard.passes.capture.static_shapes import check_static_shapes
from autoshard.passes.errors import TraceError
from autoshard.passes.graph import META, MODULE, CapturedGraph, exact_placeholder, tensor_meta_of

__all__ = ["normalize_export", "DEVICE_KWARG", "PROGRAM_MODEL_ATTR"]

DEVICE_KWARG = "autoshard.device_kwarg"
PROGRAM_MODEL_ATTR = "model"  # attribute under which the program wrapper holds the user's model
_aten = torch.ops.aten
_DROPPED_OPS = (_aten._assert_tensor_metadata.default,)


def _strip(fqn: str) -> str:
    return fqn[len(PROGRAM_MODEL_ATTR) + 1:] if fqn.startswith(PROGRAM_MODEL_ATTR + ".") else fqn


def _canonical_names(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Every FQN -> the first FQN naming the same tensor object."""
    first: dict[int, str] = {}
    out = {}
    for name, t in named:
        out[name] = first.setdefault(id(t), name)
    return out


def normalize_export(ep, model: nn.Module, input_names: list[str], *, has_target: bool, loss_fn_given: bool,
                     method: str) -> CapturedGraph:
    """The ``CapturedGraph`` of ``ep``, an export of the program wrapper around ``model`` (see the
    module docstring). ``input_names``: the user inputs' placeholder names, in order; ``has_target``:
    one more placeholder, the target, follows them; ``loss_fn_given``: the program returns a loss;
    ``method``: which tracer produced ``ep``. ``ep``'s graph is rewritten in place."""
    gm = ep.graph_module
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_canon = _canonical_names(list(model.named_parameters(remove_duplicate=False)))
    buffer_canon = _canonical_names(list(model.named_buffers(remove_duplicate=False)))

    state: dict[str, fx.Node] = {}  # canonical FQN -> placeholder
    user: list[fx.Node] = []
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            canon = (param_canon if spec.kind == InputKind.PARAMETER else buffer_canon).get(_strip(spec.target))
            if canon is None:
                raise TraceError(f"traced state {spec.target!r} is not a parameter or buffer of the model; "
                                 f"state used by loss_fn must be a plain tensor, not a registered module")
            if canon in state:  # a tied alias: read the canonical placeholder instead
                node.replace_all_uses_with(state[canon])
                graph.erase_node(node)
            else:
                state[canon] = node
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            _constant_to_get_attr(gm, node, ep.constants[spec.target], _strip(spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            user.append(node)
        else:
            raise TraceError(f"torch.export produced a {spec.kind.name} input ({spec.target}); autoshard "
                             f"supports parameters, buffers, tensor constants and tensor inputs only")

    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(f"torch.export produced a {spec.kind.name} output ({spec.target}); autoshard "
                             f"expects state updates in place (buf.copy_(...), buf.add_(...))")
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED_OPS:
            graph.erase_node(node)
    check_static_shapes(graph, type(model).__name__)

    params = _order_state(graph, state, dict(model.named_parameters()), "p_")
    buffers = _order_state(graph, state, dict(model.named_buffers()), "b_")
    ordered = list(params.values()) + list(buffers.values()) + user
    for node, name in zip(user, input_names + ["target"]):
        node._rename(name)
        node.target = node.name
    anchor = next(iter(graph.nodes))
    for node in reversed(ordered):
        anchor.prepend(node)
        anchor = node

    functionalize_view_writes(graph)
    out = _single_output(graph)
    _annotate(graph, {n for n, _ in model.named_modules()})
    graph.lint()
    new_gm = fx.GraphModule(gm, graph)
    loss_output = loss_fn_given or (isinstance(out, fx.Node) and _is_scalar_float(out))
    return CapturedGraph(
        gm=new_gm,
        params={v.name: k for k, v in params.items()},
        buffers={v.name: k for k, v in buffers.items()},
        inputs=[n.name for n in user[:len(input_names)]],
        target=user[-1].name if has_target else None,
        aliases={**{k: v for k, v in param_canon.items() if k != v},
                 **{k: v for k, v in buffer_canon.items() if k != v}},
        loss_output=bool(loss_output),
        method=method,
    )


def _constant_to_get_attr(gm: fx.GraphModule, node: fx.Node, value, fqn: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TraceError(f"the model uses a non-tensor constant {type(value).__name__} ({fqn}); "
                         f"autoshard supports tensor constants only")
    name = "_const_" + fqn.replace(".", "_")
    while hasattr(gm, name):
        name += "_"
    gm.register_buffer(name, value, persistent=False)
    with gm.graph.inserting_before(node):
        attr = gm.graph.get_attr(name)
    attr.meta.update(node.meta)
    attr.meta.setdefault("val", value)
    node.replace_all_uses_with(attr)
    gm.graph.erase_node(node)


def _order_state(graph: fx.Graph, state: dict, named: dict, prefix: str) -> dict[str, fx.Node]:
    """Placeholders for ``named`` (canonical FQN -> tensor) in that order, adding unused ones."""
    ordered = {}
    for fqn, tensor in named.items():
        node = state.get(fqn)
        if node is None:  # never read by the program (e.g. dropped by the fx fallback): keep it
            with graph.inserting_before(next(iter(graph.nodes))):
                node = exact_placeholder(graph, prefix + fqn.replace(".", "_"))
            node.meta["val"] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        node._rename(prefix + fqn.replace(".", "_"))
        node.target = node.name
        ordered[fqn] = node
    return ordered


def _single_output(graph: fx.Graph):
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = out.args[0]
    if len(values) == 1:
        out.args = (values[0],)
        return values[0]
    return values


def _is_scalar_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point


def _has_device(args) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return bool(found)


def _module_path(node: fx.Node, known: set) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack or node.op in ("placeholder", "get_attr", "output"):
        return ""
    path = list(stack.values())[-1][0]
    if path != PROGRAM_MODEL_ATTR and not path.startswith(PROGRAM_MODEL_ATTR + "."):
        return ""  # the wrapper's own code: loss_fn, output selection
    path = _strip(path) if path != PROGRAM_MODEL_ATTR else ""
    while path and path not in known:  # e.g. an indexed container the tracer spelled differently
        path = path.rpartition(".")[0]
    return path


def _annotate(graph: fx.Graph, known_modules: set) -> None:
    for node in graph.nodes:
        node.meta[META] = None if node.op == "output" else tensor_meta_of(node.meta.get("val"))
        node.meta[MODULE] = _module_path(node, known_modules)
        if _has_device((node.args, node.kwargs)):
            node.meta[DEVICE_KWARG] = True
