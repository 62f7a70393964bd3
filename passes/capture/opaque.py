"""Opaque calls: Python the program runs as written, captured as one op ``autoshard::opaque``.

A trace records the ATen ops a call makes, which is wrong or impossible for two kinds of code:

- a custom ``torch.autograd.Function`` (a straight-through quantiser: ``round`` in forward, the
  identity in backward): the trace keeps the forward's ops and autograd differentiates those, so the
  Function's own backward never runs (``round``'s gradient is zero). While capturing,
  ``opaque_functions()`` routes ``Function.apply`` of every Function defined outside torch to
  ``autoshard::opaque``, so the program calls the user's Function itself;
- a loss whose internals are data-dependent (``F.ctc_loss``: its workspace's size depends on the
  target lengths): no tracer can give its ops static shapes. ``capture`` then traces the model alone
  and calls the loss through ``opaque_loss(loss_fn)``: the loss runs as written on the model's
  output, every step.

    opaque(key, tensors) -> list of tensors

``key`` names an ``OpaqueCall`` in this process's registry (what to call, and every argument that is
not a tensor); ``tensors`` are the call's tensor arguments. The key is deterministic (the callable's
qualified name, a digest of its constant arguments and, for two different callables of one name, a
counter in capture order), so every rank that captures the same model gets the same keys.

The op has no sharding rule: it runs replicated, every rank calling it on whole tensors, and the plan
lists it with its cost. Lowered into a rank's program, the op is replaced by ``run_opaque`` (a plain
call of the user's code under autograd), so a Function's own backward runs and its forward runs
once. Elsewhere (a captured graph run as it is) the op's autograd formula re-runs the call under
autograd in the backward: the same gradients, the forward twice. The fake implementation runs a
Function's forward on fake tensors (for shapes) and gives a loss a scalar of the output's dtype.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from autoshard.passes.errors import TraceError

__all__ = ["opaque", "OpaqueCall", "opaque_functions", "opaque_loss", "run_opaque", "is_opaque", "describe_opaque",
           "data_dependent", "OPAQUE"]

_CALLS: dict[str, "OpaqueCall"] = {}


@dataclass
class OpaqueCall:
    """One opaque call site: ``run(tensors)`` computes its outputs (a list of tensors) from its tensor
    arguments; ``fake(tensors)`` gives outputs of the right shapes and dtypes from fake ones."""
    name: str
    run: Callable[[list], list]
    fake: Callable[[list], list]
    identity: tuple = ()  # what makes two call sites the same call (the callable and its constants)
    state: dict = field(default_factory=dict)  # what the first run learnt (a Function's output structure)
    key: str = field(default="", init=False)


def _register(call: OpaqueCall) -> OpaqueCall:
    """``call`` under a deterministic key; an equal call site registered before is reused."""
    digest = hashlib.sha1(repr(call.identity[1:]).encode()).hexdigest()[:10]
    n = 0
    while True:
        key = f"{call.name}:{digest}" + (f":{n}" if n else "")
        known = _CALLS.get(key)
        if known is None:
            call.key = key
            _CALLS[key] = call
            return call
        if known.identity and known.identity[0] is call.identity[0] and known.identity[1:] == call.identity[1:]:
            return known
        n += 1


def _call(key: str) -> OpaqueCall:
    try:
        return _CALLS[key]
    except KeyError:
        raise RuntimeError(f"opaque call {key!r} is not known in this process: a program with opaque calls runs "
                           "in the process that captured it (capture the model on every rank)") from None


def _aliases(t: torch.Tensor, inputs: list) -> bool:
    return any(isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
               for x in inputs)


@torch.library.custom_op("autoshard::opaque", mutates_args=())
def opaque(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The call ``key`` on ``tensors`` (see the module docstring)."""
    tensors = list(tensors)
    with torch.no_grad():
        outs = _call(key).run(tensors)
    # a custom op's outputs may not alias its inputs (a Function may return its input or a view of it)
    return [o.clone() if _aliases(o, tensors) else o for o in outs]


@opaque.register_fake
def _opaque_fake(key, tensors):
    with torch.no_grad():
        return list(_call(key).fake(list(tensors)))


def _setup(ctx, inputs, output):
    key, tensors = inputs
    ctx.key = key
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads):
    tensors = list(ctx.saved_tensors)
    leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors]
    with torch.enable_grad():
        outs = _call(ctx.key).run(leaves)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in leaves if t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
               if pairs and wanted else [None] * len(wanted))
    return None, [next(got) if t.requires_grad else None for t in leaves]


opaque.register_autograd(_backward, setup_context=_setup)

#: the op a captured graph holds for an opaque call
OPAQUE = torch.ops.autoshard.opaque.default


def is_opaque(target) -> bool:
    return target is OPAQUE


def run_opaque(key: str, tensors: list) -> list:
    """The call ``key`` run as written under the caller's grad mode: what a rank's program calls in place
    of the op, so a Function's own backward node is recorded (one forward, the user's backward)."""
    return list(_call(key).run(list(tensors)))


def describe_opaque(node) -> str:
    """What an opaque node calls, for messages: ``autograd.Function mymod.STE``, ``loss_fn ctc``."""
    key = node.args[0] if node.args else ""
    call = _CALLS.get(key)
    return call.name if call is not None else str(key)


# ---- custom autograd Functions --------------------------------------------------------------

def _function_call(cls: type, args: tuple, kwargs: dict, original_apply) -> tuple[OpaqueCall, list]:
    """The registered call of ``cls.apply(*args, **kwargs)`` and its tensor arguments."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    template = [None if isinstance(x, torch.Tensor) else x for x in flat]
    is_tensor = [isinstance(x, torch.Tensor) for x in flat]
    state: dict[str, Any] = {}

    def run(ts: list) -> list:
        it = iter(ts)
        a, k = pytree.tree_unflatten([next(it) if t else x for x, t in zip(template, is_tensor)], spec)
        leaves, out_spec = pytree.tree_flatten(original_apply(cls, *a, **k))
        state.setdefault("out", (out_spec, [None if isinstance(x, torch.Tensor) else x for x in leaves]))
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    name = f"autograd.Function {cls.__module__}.{cls.__qualname__}"
    call = _register(OpaqueCall(name, run, run, (cls, repr(spec), repr(template)), state))
    return call, tensors


def _rebuild_outputs(call: OpaqueCall, outs: list):
    out_spec, template = call.state["out"]
    it = iter(outs)
    return pytree.tree_unflatten([next(it) if x is None else x for x in template], out_spec)


def _user_function(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return not (module == "torch" or module.startswith("torch."))


@contextlib.contextmanager
def opaque_functions():
    """While active, ``Function.apply`` of a Function defined outside torch calls
    ``autoshard::opaque`` instead of the Function, so a trace records one op that runs the Function
    itself. Restores ``Function.apply`` on exit."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]
    original_apply = original.__func__

    def apply(cls, *args, **kwargs):
        if not _user_function(cls):
            return original_apply(cls, *args, **kwargs)
        call, tensors = _function_call(cls, args, kwargs, original_apply)
        return _rebuild_outputs(call, OPAQUE(call.key, tensors))

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


# ---- losses whose internals are data-dependent ----------------------------------------------

def opaque_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` as one opaque op: ``(output, target) -> scalar``. The model's output is flattened to
    its tensors (``outputs.flatten_output``: tensors, tuples, dicts, dataclasses, ModelOutputs) and
    rebuilt for every call, so ``loss_fn`` receives what the model returns. The loss is a scalar of the
    output's floating dtype (a loss computed in another dtype is cast to it)."""
    from autoshard.passes.capture.outputs import flatten_output

    def call_loss(out, target):
        tensors, structure = flatten_output(out)
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        dtype = floats[0] if floats else torch.get_default_dtype()
        for d in floats[1:]:
            dtype = torch.promote_types(dtype, d)
        n = len(tensors)
        has_target = isinstance(target, torch.Tensor)

        def run(ts: list) -> list:
            loss = loss_fn(structure.rebuild(ts[:n]), ts[n] if has_target else target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TraceError(f"loss_fn returned {type(loss).__name__}"
                                 f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}; "
                                 "a training loss is a scalar tensor (reduce it, e.g. .mean())")
            return [loss.to(dtype)]

        def fake(ts: list) -> list:
            return [torch.empty((), dtype=dtype, device=ts[0].device if ts else None)]

        name = f"loss_fn {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"
        call = _register(OpaqueCall(name, run, fake, (loss_fn, _layout(structure.template), str(dtype), has_target)))
        return OPAQUE(call.key, tensors + ([target] if has_target else []))[0]

    return call_loss


def _layout(template) -> str:
    """A deterministic description of an output structure's template (types and tensor positions)."""
    items = getattr(template, "items", None)
    if items is None:
        index = getattr(template, "index", None)
        return f"T{index}" if index is not None else repr(template)
    kind = template.kind.__qualname__
    if isinstance(items, dict):
        return f"{kind}{{" + ",".join(f"{k}:{_layout(v)}" for k, v in items.items()) + "}"
    return f"{kind}[" + ",".join(_layout(v) for v in items) + "]"


_DATA_DEPENDENT = {"DynamicOutputShapeException", "DataDependentOutputException", "GuardOnDataDependentSymNode",
                   "PendingUnbackedSymbolNotFound"}


def data_dependent(error: Optional[BaseException]) -> bool:
    """Whether ``error`` (or an exception it was raised from, or one it wraps as ``.error``) is a tracer's
    data-dependent-shape or data-dependent-guard failure."""
    seen = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__ in _DATA_DEPENDENT:
            return True
        todo += [e.__cause__, e.__context__, getattr(e, "error", None)]
    return False
