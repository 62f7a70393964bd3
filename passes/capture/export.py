"""Capture pass: an ``nn.Module`` and example inputs -> ``CapturedGraph`` (an ATen-level fx program).

``capture`` runs three steps:

1. The user's call becomes a program wrapper (``_Program``): each example tensor a placeholder
   named after the forward's parameters or the dict keys, other inputs baked in as constants, and
   the output reduced by ``loss_fn`` (which receives exactly what the model returns: a tensor, a
   tuple, a dict, a dataclass or a Hugging Face ``ModelOutput``) or, without one, returned: a tensor
   or a tuple of tensors as is, an HF output's scalar ``.loss`` when labels were given, else all
   the output's tensors with its structure kept (``passes.capture.outputs``). A buffer reassigned in forward (``self.buf = f(self.buf)``) becomes an in-place
   ``copy_``, which every tracer records.
2. ``passes.capture.tracers`` traces the wrapper with ``torch.export.export(strict=False)``
   (training IR: high-level ATen ops such as ``aten.linear`` survive, in-place buffer updates stay in
   place), retrying through ``torch.fx.symbolic_trace`` when export fails (which drops Python side
   effects such as statistics logged with ``.numpy()``); ``method`` says which path was used. If
   both fail, ``TraceError`` names the construct and the user's file:line. Export's grad-mode and
   disabled-autocast regions are inlined (outputs of a no-grad region that depend on a parameter
   are wrapped in ``aten.detach``).
3. ``passes.capture.normalize`` brings the export into the contract of ``passes.graph.CapturedGraph``:
   parameters, buffers, user inputs, then the target as placeholders, so
   ``gm(*model.parameters(), *model.buffers(), *inputs[, target])`` runs the program; one placeholder
   per tied tensor; module paths and tensor metadata on every node.

``set_graph_device`` retargets a captured program (traced on the meta device, say) to a real device.

>>> cg = capture(nn.Linear(4, 2), (torch.randn(8, 4),))  # fx renames ``input`` (a builtin)
>>> list(cg.params.values()), cg.inputs, cg.loss_output
(['weight', 'bias'], ['input_1'], False)
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.fx as fx
from torch.fx import config as fx_config
import torch.nn as nn

from autoshard.passes.capture.arguments import check_loss_arguments, check_loss_output
from autoshard.passes.capture.moe_experts import fused_experts
from autoshard.passes.capture.normalize import DEVICE_KWARG, normalize_export
from autoshard.passes.capture.opaque import data_dependent, opaque_functions, opaque_loss
from autoshard.passes.capture.outputs import OutputStructure, flatten_output
from autoshard.passes.capture.static_shapes import data_dependent_node
from autoshard.passes.capture.tracers import LossFnError, trace
from autoshard.passes.errors import TraceError
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.spec import TensorMeta

__all__ = ["capture", "set_graph_device"]


# ---------------------------------------------------------------------------------------------
# the user's call: which example inputs are tensors (placeholders) and what they are called


@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass
class _Call:
    """``model(*args, **kwargs)`` with each tensor replaced by ``_Slot(i)`` (i: placeholder order).

    ``names``: placeholder name of each tensor; ``constants``: the other inputs by parameter name
    (baked into the program; the fx fallback traces with them fixed).
    """
    args: tuple
    kwargs: dict
    names: list[str]
    tensors: list[torch.Tensor]
    constants: dict[str, Any]
    output_structure: Optional[OutputStructure] = None

    def bind(self, flat) -> tuple[tuple, dict]:
        put = lambda v: flat[v.index] if isinstance(v, _Slot) else v  # noqa: E731
        return tuple(put(a) for a in self.args), {k: put(v) for k, v in self.kwargs.items()}


def _positional_names(model: nn.Module, n: int) -> list[str]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}_{i}" for i in range(n - len(names))]
    return names[:n] + [f"input_{i}" for i in range(len(names), n)]


def _make_call(model: nn.Module, example_inputs) -> _Call:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        pairs, args_mode = list(example_inputs.items()), False
    elif isinstance(example_inputs, (tuple, list)):
        pairs = list(zip(_positional_names(model, len(example_inputs)), example_inputs))
        args_mode = True
    else:
        raise TraceError(
            f"example_inputs must be a tuple of tensors or a dict of keyword tensors, got "
            f"{type(example_inputs).__name__}; pass e.g. example_inputs=(x,) or {{'input_ids': ids}}")
    names, tensors, values, constants = [], [], [], {}
    for name, value in pairs:
        if isinstance(value, torch.Tensor):
            values.append(_Slot(len(tensors)))
            names.append(str(name))
            tensors.append(value)
        elif isinstance(value, (list, tuple, dict)) and any(
                isinstance(v, torch.Tensor) for v in (value.values() if isinstance(value, dict) else value)):
            raise TraceError(
                f"example input {name!r} is a {type(value).__name__} of tensors; autoshard needs each "
                f"tensor as its own argument: pass them as separate positional or keyword inputs")
        else:
            values.append(value)
            constants[str(name)] = value
    if args_mode:
        return _Call(tuple(values), {}, names, tensors, constants)
    return _Call((), dict(zip([k for k, _ in pairs], values)), names, tensors, constants)


# ---------------------------------------------------------------------------------------------
# the traced program: model call, then loss_fn or output selection


def _pick_output(out, call: "_Call"):
    """What the program returns when no loss_fn is given: a tensor or a tuple of tensors as they are;
    a Hugging Face output holding a scalar ``.loss`` (labels given): that loss, so the program trains
    on it; any other output (ModelOutput, dataclass, dict, nested containers): its tensors, with the
    structure kept in ``call.output_structure`` for the runtime to rebuild."""
    if isinstance(out, torch.Tensor):
        return out
    if type(out) is tuple and out and all(isinstance(o, torch.Tensor) for o in out):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    tensors, call.output_structure = flatten_output(out)
    if not tensors:
        raise TraceError(f"the model returned {type(out).__name__} with no tensor in it; autoshard captures "
                         f"models whose output holds tensors")
    return tuple(tensors)


class _Program(nn.Module):
    """``forward(*inputs[, target])``: the user's call, reduced to what the graph returns. Holds the
    user's model as ``self.model`` (``normalize.PROGRAM_MODEL_ATTR``, the prefix normalization strips)."""

    def __init__(self, model: nn.Module, call: _Call, loss_fn: Optional[Callable], has_target: bool):
        super().__init__()
        self.model = model
        # not registered as submodules: a loss module's tensors are constants, not model state
        self.__dict__["_call"] = call
        self.__dict__["_loss_fn"] = loss_fn
        self.__dict__["_has_target"] = has_target

    def forward(self, *flat):
        n = len(self._call.tensors)
        args, kwargs = self._call.bind(flat[:n])
        before = list(self.model.named_buffers(remove_duplicate=False))
        out = self.model(*args, **kwargs)
        _reassigned_buffers_to_copy(self.model, before)
        if self._loss_fn is not None:
            target = flat[n] if self._has_target else None
            try:  # loss_fn gets exactly what the model returned, as in eager PyTorch
                return self._loss_fn(out, target)
            except Exception as e:  # noqa: BLE001 - re-raised, marked as the loss's own error
                raise LossFnError(e) from e
        return _pick_output(out, self._call)


def _reassigned_buffers_to_copy(model: nn.Module, before: list) -> None:
    """``self.buf = f(self.buf)`` -> ``buf.copy_(f(buf))`` and the original buffer put back.

    torch.export records such a reassignment only on the root module, and the user's model is a
    submodule of ``_Program``; an in-place copy is traced on every path.
    """
    for name, old in before:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        new = module._buffers.get(leaf)
        if new is not old and isinstance(new, torch.Tensor):
            module._buffers[leaf] = old
            old.copy_(new)


# ---------------------------------------------------------------------------------------------
# the front door


def capture(model: nn.Module, example_inputs, *, loss_fn: Optional[Callable] = None,
            target: Optional[torch.Tensor] = None, param_dtype: Optional[torch.dtype] = None,
            fuse_experts: bool = True, stack_traces: bool = True) -> CapturedGraph:
    """Trace ``model`` on ``example_inputs`` into a ``CapturedGraph`` (see the module docstring).

    ``example_inputs``: a tuple of positional inputs or a dict of keyword inputs (HF style); tensors
    become placeholders named after the forward's parameters / the dict keys, other values are
    baked in as constants. ``loss_fn(output, target)``: when given, the program returns this scalar;
    ``output`` is exactly what the model returns (an HF ``ModelOutput`` whole: ``out.logits`` is the
    loss's to pick), and an exception the loss raises is reported as the loss's (``TraceError``
    naming its type and the loss's file:line); ``target`` (a tensor) becomes the last placeholder.
    Without ``loss_fn`` the program returns the model's tensor, tuple of tensors, an HF output's
    scalar ``.loss``, or every tensor of any other output, whose structure
    ``CapturedGraph.output_structure`` rebuilds. The model is traced in its current train/eval mode and is not
    modified. Shapes are static: the program is specialized to these example shapes. ``loss_fn`` and
    ``target`` come together (``arguments.check_loss_arguments`` names the missing one).

    ``param_dtype`` (mixed precision): trace with every floating parameter cast to this dtype, so
    the program's ops and dtypes are those of a run computing in it; the graph's parameter
    placeholders carry ``param_dtype`` and ``CapturedGraph.master_dtypes`` records the model's own
    dtypes. The tracer sees a copy of the module tree holding cast copies of the parameters (buffers
    shared), so the user's model is never touched, not even for the duration of the trace. Floating
    inputs are cast to it too (as FSDP2's ``cast_forward_inputs``); the target keeps its dtype.

    ``fuse_experts``: trace each recognised mixture-of-experts experts module as one
    ``autoshard::moe_experts`` op (``passes.capture.moe_experts``), which the planner may run expert
    parallel; False traces them as written. (For the trace only, those modules' ``forward`` is
    swapped on the traced module tree; it is restored before ``capture`` returns.)

    ``stack_traces``: record on every node the user's source line that made it
    (``node.meta["stack_trace"]``, what fx shows when a node of a running program fails). A program
    that is only priced, never run (``autoshard.plan``), may skip it: on Llama-3 8B that is about a
    quarter of the trace's CPU. The error naming an op whose size depends on values
    (``static_shapes``) still names the user's line: on that error the model is traced again with them.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"capture needs an nn.Module, got {type(model).__name__}; wrap the function in a module")
    if target is not None and not isinstance(target, torch.Tensor):
        raise TraceError(f"target must be a tensor or None, got {type(target).__name__}")
    given = dict(loss_fn=loss_fn, target=target, param_dtype=param_dtype, fuse_experts=fuse_experts)
    check_loss_arguments(loss_fn, target, lambda: _output_shapes(model, example_inputs))
    call = _make_call(model, example_inputs)
    if param_dtype is not None:
        call.tensors[:] = [t.to(param_dtype) if t.is_floating_point() else t for t in call.tensors]
    state_device = _state_device(model)
    if state_device is not None and state_device.type == "meta":
        # Planning a meta model on real data: trace on meta twins of the inputs (nothing allocated).
        call.tensors[:] = [t.to("meta") for t in call.tensors]
        target = target.to("meta") if target is not None else None
    else:
        _check_devices(state_device, call.tensors + ([target] if target is not None else []))
    flat = call.tensors + ([target] if target is not None else [])
    make_program = lambda m: _Program(m, call, loss_fn, target is not None)  # noqa: E731
    traced, masters = (model, {}) if param_dtype is None else _with_cast_parameters(model, param_dtype)
    with fused_experts(traced) if fuse_experts else contextlib.nullcontext(), opaque_functions(), \
            _recording_stack_traces(stack_traces):
        try:
            ep, method = trace(traced, make_program, flat, call.constants)
        except TraceError as e:
            if loss_fn is None or not data_dependent(e):
                raise _blame_the_loss(model, example_inputs, loss_fn, target, e) or e
            # the loss's internals have data-dependent shapes (F.ctc_loss): it runs as written, one opaque op
            make_program = lambda m: _Program(m, call, opaque_loss(loss_fn), target is not None)  # noqa: E731
            try:
                ep, method = trace(traced, make_program, flat, call.constants)
            except TraceError as again:
                raise _blame_the_loss(model, example_inputs, loss_fn, target, again) or again
    try:
        captured = normalize_export(ep, traced, call.names, has_target=target is not None,
                                    loss_fn_given=loss_fn is not None, method=method)
    except TraceError:
        if stack_traces or data_dependent_node(ep.graph) is None:
            raise
        return capture(model, example_inputs, **given)  # raises again, naming the user's line this time
    if loss_fn is not None:
        check_loss_output(captured.output_node.args[0], loss_fn)
    captured.master_dtypes = {ph: masters[fqn] for ph, fqn in captured.params.items() if fqn in masters}
    if loss_fn is None and call.output_structure is not None:
        captured.output_structure = call.output_structure
        captured.loss_output = False  # a scalar field of the output is an output, not a loss
    return captured


@contextlib.contextmanager
def _recording_stack_traces(record: bool):
    """While tracing: whether fx records each node's source line (``torch.fx.config``, read when the
    tracer is made); the setting is put back after."""
    old = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = old or not record
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = old


def _with_cast_parameters(model: nn.Module, dtype) -> tuple[nn.Module, dict[str, torch.dtype]]:
    """A copy of ``model``'s module tree whose floating parameters are cast copies in ``dtype``
    (ties kept, buffers shared), and FQN -> original dtype of each cast parameter."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TraceError(f"param_dtype={dtype!r}: pass a floating torch dtype such as torch.bfloat16")
    memo: dict[int, Any] = {}
    masters: dict[str, torch.dtype] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in memo:
            continue
        if p.is_floating_point() and p.dtype != dtype:
            memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            masters[name] = p.dtype
        else:
            memo[id(p)] = p
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo), masters


def _blame_the_loss(model: nn.Module, example_inputs, loss_fn, target, error: TraceError) -> Optional[TraceError]:
    """When the program (forward + loss) cannot be captured but the forward alone can, the loss is the
    cause: a TraceError saying so (with what it was given), else None."""
    if loss_fn is None:
        return None
    shapes = _output_shapes(model, example_inputs)
    if shapes is None:
        return None
    said = next((ln.strip() for ln in str(error).splitlines() if "torch.export said:" in ln), "")
    target_shape = tuple(target.shape) if target is not None else None
    if str(error).startswith("loss_fn raised"):  # the loss's own exception: keep it, add what it was given
        first, _, rest = str(error).partition("\n")
        return TraceError(f"{first}\n  loss_fn failed on the model's output (shapes {[tuple(s) for s in shapes]}) "
                          f"and example_target (shape {target_shape}); the model's forward alone captures fine.\n"
                          f"{rest}")
    return TraceError(
        f"autoshard could not capture {type(model).__name__}: loss_fn failed on the model's output (shapes "
        f"{[tuple(s) for s in shapes]}) and example_target (shape {target_shape})"
        f"; the model's forward alone captures fine.\n  {said}\n  fix: call loss_fn(model(*example_inputs), "
        "example_target) directly to see the error; check example_target's shape and dtype against what loss_fn "
        "expects.")


def _output_shapes(model: nn.Module, example_inputs) -> Optional[list]:
    """Shapes of the model's outputs, traced without a loss; None when that fails too."""
    try:
        out = capture(model, example_inputs).output_node.args[0]
    except Exception:  # noqa: BLE001 - only a hint for another error's message
        return None
    outs = out if isinstance(out, (tuple, list)) else [out]
    metas = [o.meta.get(META) for o in outs if isinstance(o, fx.Node)]
    return [m.shape for m in metas if isinstance(m, TensorMeta)] or None


def _state_device(model: nn.Module) -> Optional[torch.device]:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def _check_devices(state_device: Optional[torch.device], tensors: list) -> None:
    if state_device is None:
        return
    for t in tensors:
        if t.device.type != "meta" and t.device != state_device:
            raise TraceError(f"the model's parameters are on {state_device} but an example input is on {t.device}: "
                             f"put them on the same device (or build the model on meta to plan without memory)")


# ---------------------------------------------------------------------------------------------
# after capture


def set_graph_device(gm: fx.GraphModule, device: Union[str, torch.device]) -> fx.GraphModule:
    """A copy of ``gm`` whose factory / transfer ops create tensors on ``device``.

    Every ``torch.device`` argument of a node marked ``autoshard.device_kwarg`` becomes
    ``device``, and tensor constants (buffers of ``gm``) are moved there; ``gm`` is not modified.
    A graph captured on the meta device runs on CPU tensors after ``set_graph_device(gm, "cpu")``.
    """
    device = torch.device(device)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    old_out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(graph.graph_copy(gm.graph, env)).meta.update(old_out.meta)
    swap = lambda a: device if isinstance(a, torch.device) else a  # noqa: E731
    for node in graph.nodes:
        if node.meta.get(DEVICE_KWARG):
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    new = fx.GraphModule(gm, graph)
    for name, buf in list(new.named_buffers()):
        if buf.is_meta and device.type != "meta":
            raise TraceError(f"graph constant {name} was traced on the meta device and has no values; "
                             f"create it from a parameter/buffer or build the model on a real device")
        owner, _, leaf = name.rpartition(".")
        new.get_submodule(owner).register_buffer(leaf, buf.to(device), persistent=False)
    return new
