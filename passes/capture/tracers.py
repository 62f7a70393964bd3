"""Running the tracers for ``passes.capture.export``: torch.export first, a torch.fx fallback, a clear error.

The program ``trace`` hands back is flat: the higher-order ops export wraps grad-mode and
autocast(enabled=False) regions in are inlined.

``trace`` exports the program wrapper (``torch.export.export(strict=False)``). If export rejects
the model, ``export_via_symbolic_trace`` runs ``torch.fx.symbolic_trace`` on the user's model
first: its proxies record only tensor dataflow, so Python side effects that export cannot run on
fake tensors (statistics logged with ``.numpy()``, ``data_ptr()`` bookkeeping) fall away as dead
code. The resulting GraphModule keeps the model's submodule paths and parameter names and is then
exported like the original, so both paths yield the same ATen training IR. Module paths are
coarser on that path: symbolic_trace inlines non-leaf submodules, so only leaf modules such as
``nn.Linear`` keep their own path.

If both fail, ``trace_error`` builds the ``TraceError``: the construct, the innermost frame of the
user's code (file:line and source), and what to change. An exception raised inside the user's
``loss_fn`` (marked ``LossFnError`` by the program wrapper) skips the fallback, which would run the
same loss: ``loss_fn_trace_error`` names it as the loss's, with its type and the loss's file:line.
Neither path leaves anything on the user's modules (tracers assign attributes such as
``self.last = y`` while running forward).
"""
from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import sys
import sysconfig
import traceback
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind

from autoshard.passes.capture.eager_check import eager_error
from autoshard.passes.errors import TraceError

__all__ = ["LossFnError", "trace", "export_via_symbolic_trace", "trace_error", "user_frame"]


class LossFnError(Exception):
    """An exception the user's ``loss_fn`` raised while traced (``error``): no tracer can get past it,
    and the cause is the loss, not the model nor a tracing limit."""

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


METHOD_EXPORT = "export"
METHOD_FX = "symbolic_trace"


def trace(model: nn.Module, make_program: Callable[[nn.Module], nn.Module], flat: list,
          constants: dict) -> tuple["torch.export.ExportedProgram", str]:
    """``(exported program, method)`` for ``make_program(model)`` called on ``flat``.

    ``make_program`` wraps a module into the program to trace (it is applied to the user's model,
    or to its symbolic-traced copy on the fallback path); ``constants``: the non-tensor inputs by
    name. The returned graph has no higher-order ops: export's grad-mode and disabled-autocast
    regions are inlined (outputs of a no-grad region that depend on a parameter get an
    ``aten.detach``). Raises ``TraceError`` when neither tracer accepts the model or the graph
    holds other control flow.
    """
    with _preserved(model):
        try:
            ep, method = _export(make_program(model), flat), METHOD_EXPORT
        except TraceError:
            raise
        except Exception as export_error:  # noqa: BLE001 - any tracer failure goes to the fallback
            if _loss_fn_error(export_error) is not None:
                raise loss_fn_trace_error(_loss_fn_error(export_error)) from export_error
            try:
                ep, method = export_via_symbolic_trace(model, make_program, flat, constants), METHOD_FX
            except Exception as fallback_error:  # noqa: BLE001
                if _loss_fn_error(fallback_error) is not None:
                    raise loss_fn_trace_error(_loss_fn_error(fallback_error)) from fallback_error
                eager = eager_error(make_program(model), flat, is_loss_error=lambda e: _loss_fn_error(e) is not None)
                raise trace_error(model, export_error, fallback_error, eager) from export_error
    params = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    _inline_regions(ep.graph_module, {n for n in ep.graph.nodes if n.op == "placeholder" and n.name in params})
    return ep, method


@contextlib.contextmanager
def _preserved(model: nn.Module):
    """Put back every attribute the tracers set on the user's modules."""
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, params, buffers, modules in saved:
            for d, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                d.clear()
                d.update(old)
            for key in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[key]
            m.__dict__.update({k: v for k, v in attrs.items() if m.__dict__.get(k) is not v})


def _export(program: nn.Module, flat: list) -> "torch.export.ExportedProgram":
    # A failed export prints its partial graph to stderr and logs a warning about it; the
    # TraceError (or the fallback) says it better, so that dump is dropped and the rest kept.
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    old_level, err = logger.level, io.StringIO()
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(err):
            return torch.export.export(program, tuple(flat), strict=False)
    except Exception as e:
        dump = str(getattr(e, "partial_fx_graph", "") or "")
        err = io.StringIO(err.getvalue().replace(dump, "") if dump else err.getvalue())
        raise
    finally:
        logger.setLevel(old_level)
        if err.getvalue().strip():
            sys.stderr.write(err.getvalue().strip("\n") + "\n")


def _region_args(node: fx.Node):
    """(subgraph get_attr node, operands, detach outputs?) of an inlinable higher-order op, else None."""
    name = getattr(node.target, "__name__", str(node.target))
    if name == "wrap_with_set_grad_enabled":
        enabled, sub, *ops = node.args
        return sub, ops, not enabled
    if name == "wrap_with_autocast":
        _device_type, _dtype, enabled, _cache, sub, *ops = node.args
        if enabled:
            raise TraceError(f"torch.autocast is enabled inside the model's forward ({node.name}); autoshard "
                             f"traces one precision: remove the autocast region or cast the model instead")
        return sub, ops, False
    return None


def _depends_on(node: fx.Node, sources: set) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _inline_regions(gm: fx.GraphModule, param_nodes: set) -> None:
    """Inline export's grad-mode / autocast(enabled=False) regions into the main graph. A no-grad region's
    operands computed from parameters are read through ``detach`` (its ops build no autograd graph, as in
    eager: spectral norm's power iteration writes its buffers with ``out=``, which autograd refuses on a
    value that requires grad) and its results are detached."""
    graph = gm.graph
    while True:
        hops = [n for n in graph.nodes
                if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)]
        if not hops:
            return
        node = hops[0]
        region = _region_args(node)
        if region is None:
            raise TraceError(f"torch.export produced the higher-order op {node.target} ({node.name}); "
                             f"autoshard cannot plan control flow (torch.cond / loops): rewrite it with "
                             f"tensor ops such as torch.where")
        sub_attr, ops, detach = region
        sub = getattr(gm, sub_attr.target)
        env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], ops))
        results = ()
        with graph.inserting_before(node):
            if detach:  # a no-grad region reads what it is given as constants, as eager autograd does
                for p, op in list(env.items()):
                    if p.users and isinstance(op, fx.Node) and _depends_on(op, param_nodes):
                        env[p] = _detached(graph, op)
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    results = fx.node.map_arg(n.args[0], lambda a: env[a])
                    continue
                new = graph.node_copy(n, lambda a: env[a])
                if n.op == "get_attr":
                    new.target = _fresh_attr(gm, getattr(sub, n.target))
                new.meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack", {}))
                env[n] = new
            if detach:
                results = tuple(_detached(graph, r) if isinstance(r, fx.Node) and _depends_on(r, param_nodes)
                                else r for r in results)
        for use in list(node.users):
            if use.target is not operator.getitem:
                raise TraceError(f"unexpected use {use.name} of region {node.name}")
            use.replace_all_uses_with(results[use.args[1]])
            graph.erase_node(use)
        graph.erase_node(node)
        if not sub_attr.users:
            graph.erase_node(sub_attr)


def _fresh_attr(gm: fx.GraphModule, value) -> str:
    i = 0
    while hasattr(gm, f"_inlined_{i}"):
        i += 1
    setattr(gm, f"_inlined_{i}", value)
    return f"_inlined_{i}"


def _detached(graph: fx.Graph, node: fx.Node) -> fx.Node:
    new = graph.call_function(torch.ops.aten.detach.default, (node,))
    new.meta.update({k: node.meta[k] for k in ("val", "nn_module_stack") if k in node.meta})
    return new


class _BufferProxyTracer(fx.Tracer):
    """symbolic_trace that also records buffer reads, so ``self.buf.add_(1)`` is traced, not run."""
    proxy_buffer_attributes = True


def _keeps_side_effect(node: fx.Node) -> bool:
    """Dead-code rule for symbolic_trace graphs: in-place methods/functions (``x.add_``) stay."""
    if node.is_impure():
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")


def export_via_symbolic_trace(model: nn.Module, make_program: Callable[[nn.Module], nn.Module], flat: list,
                              constants: dict) -> "torch.export.ExportedProgram":
    """Export ``make_program(symbolic_trace(model))`` on ``flat``, dead code of the fx graph removed.

    ``constants`` are fixed while tracing (``concrete_args``) so Python branches on them resolve.
    """
    graph = _BufferProxyTracer().trace(model, concrete_args=constants or None)
    traced = fx.GraphModule(model, graph, class_name=type(model).__name__)
    traced.graph.eliminate_dead_code(is_impure_node=_keeps_side_effect)
    traced.recompile()
    return _export(make_program(traced), flat)


def _is_user_file(filename: str, torch_dir: str, own_dir: str, stdlib: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(torch_dir) or path.startswith(own_dir):
        return False
    # third-party model code (e.g. transformers) in site-packages is the user's code here
    return "site-packages" in path.split(os.sep) or not path.startswith(stdlib)


def user_frame(error: Optional[BaseException]) -> Optional[traceback.FrameSummary]:
    """The innermost traceback frame of ``error`` (or what it was raised from) in user code."""
    dirs = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)),
            sysconfig.get_paths()["stdlib"])
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = [f for f in traceback.extract_tb(error.__traceback__) if _is_user_file(f.filename, *dirs)]
        if frames:
            return frames[-1]
        error = error.__cause__ or error.__context__
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}"[:300]


def _classify(export_error: BaseException, fallback_error: BaseException,
              eager: Optional[BaseException] = None) -> tuple[str, str]:
    """(what stopped the capture, what to do). The model's own exception first: ``eager``, what the
    program raised when called directly (``eager_check``), means the inputs or the model are wrong,
    whatever the tracers say. Then torch.export's error alone (the fx fallback stops at any branch on a
    shape, which export traces fine, so its "control flow" is no evidence), then both together."""
    if eager is not None:
        return (f"an error the model's forward raises on these example inputs ({_first_line(eager)}), not a "
                "tracing limit: calling the model directly on them raises it too",
                "call the model on the example inputs directly to see it; check each input's shape and dtype, that "
                "every argument the model needs is passed (one left out arrives as None), and the model's "
                "configuration (e.g. a width that does not divide into its heads)")
    said = f"{type(export_error).__name__} {export_error}"
    if "data-dependent" in said or "DataDependent" in said:
        return _DATA_DEPENDENT
    if "fake" in said.lower() and ("impl" in said or "kernel" in said):
        return ("an operator with no meta/fake implementation",
                "register one with torch.library.register_fake, or move the op out of forward")
    if _first_line(export_error) == _first_line(fallback_error) and not isinstance(export_error, TraceError):
        return (f"an error the model's forward raises on these example inputs ({_first_line(export_error)}), not a "
                "tracing limit: both tracers stop at the same line",
                "call the model on the example inputs directly to see it; check their shapes and dtypes, and the "
                "model's configuration (e.g. a width that does not divide into its heads)")
    if "cannot be used as inputs to control flow" in str(fallback_error) and isinstance(export_error, TraceError):
        return _DATA_DEPENDENT
    return ("a construct the tracers do not support",
            "rewrite it with plain tensor ops that depend only on shapes, not on tensor values")


_DATA_DEPENDENT = ("Python control flow or a Python number that depends on tensor values "
                   "(e.g. `if x.sum() > 0:`, `float(t)`, `.item()`)",
                   "express it with tensor ops (torch.where, masking) or compute it outside the model and pass "
                   "it in as an input")


def _loss_fn_error(error: Optional[BaseException]) -> Optional[LossFnError]:
    """The ``LossFnError`` that ``error`` is or was raised from (a tracer may wrap it), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, LossFnError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def loss_fn_trace_error(marked: LossFnError) -> TraceError:
    """The TraceError for an exception raised inside the user's loss_fn: its type, message and the
    loss's own file:line (the innermost frame outside torch and autoshard)."""
    error = marked.error
    frame = user_frame(error)
    where = (f" at {frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
             if frame else "")
    return TraceError(
        f"loss_fn raised {_first_line(error)}{where}.\n"
        f"  loss_fn(output, target) receives exactly what the model returns (a Hugging Face ModelOutput whole: "
        f"take .logits inside the loss) and example_target.\n"
        f"  fix: call loss_fn(model(*example_inputs), example_target) directly to see it.")


def trace_error(model: nn.Module, export_error: BaseException, fallback_error: BaseException,
                eager: Optional[BaseException] = None) -> TraceError:
    """The TraceError for a model neither ``torch.export`` nor the fx fallback could capture;
    ``eager``: what the program raised when run directly on the example inputs (None: it ran)."""
    construct, fix = _classify(export_error, fallback_error, eager)
    frame = user_frame(eager) or user_frame(export_error) or user_frame(fallback_error)
    where = (f"{frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"
             if frame else "an unknown location (no user frame in the traceback)")
    return TraceError(
        f"autoshard could not capture {type(model).__name__}: {construct} at {where}.\n"
        f"  torch.export said: {_first_line(export_error)}\n"
        f"  the torch.fx fallback said: {_first_line(fallback_error)}\n"
        f"  fix: {fix}."
    )
