"""What a node's backward allocates beyond its operands' gradients: the intermediate gradients of the
ops it is made of.

A node of the captured program is one ATen call, but its backward may be several: ``cross_entropy``
differentiates as ``nll_loss_backward`` (a zero-filled gradient of the log-probabilities, the size of
the logits) then ``_log_softmax_backward_data`` (the logits' gradient), so at its backward two
logits-sized tensors are alive where the step walk (``passes.solve.peak_timeline``) counted one.
Measured (issue 27): a 7.3 M Llama with an 8,192 vocabulary peaks there, 8 MiB above the walk.

``backward_workspace(node)`` runs the node alone on the meta device (nothing is allocated): its
operands as meta tensors (those that need a gradient in the program marked so), the op, then its
backward from gradients of its differentiable outputs, under a dispatch mode that follows every
storage the backward makes. The answer is the most bytes alive at once among those that are not the
gradients it returns, at the node's global shapes (``0`` for a single-kernel backward such as
``mm``'s or ``silu``'s). Attention runs as the fused kernel (``saved.fused_attention``), as the
runtime runs it; kernels' own scratch (inside one ATen call) is not seen, here as by ``MemTracker``.

Results are cached per (op, operand shapes and dtypes, which operands need gradients, other
arguments), so repeated blocks are run once; a node that cannot run on the meta device (an op
without a meta kernel, a Python callable) gets 0.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.passes.capture.saved import attention_call, fused_attention, run_as_saved
from autoshard.passes.op_facts import op_facts
from autoshard.passes.graph import META
from autoshard.passes.spec import TensorMeta

__all__ = ["backward_workspace"]

_CACHE: dict[tuple, int] = {}


class _BackwardStorages(TorchDispatchMode):
    """Follows the storages the ops under it make: which are alive after each op."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, int] = {}  # storage key -> bytes, while alive
        self.timeline: list[dict[int, int]] = []
        self._refs: list = []

    def _forget(self, key: int, _ref) -> None:
        self.alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.alive and key not in read:  # a view or an in-place result is no new storage
                    self.alive[key] = st.nbytes()
                    self._refs.append(weakref.ref(st, lambda r, k=key: self._forget(k, r)))
        self.timeline.append(dict(self.alive))
        return out


def _signature(node: fx.Node, needs_grad: Callable[[fx.Node], bool]) -> Optional[tuple]:
    parts = []

    def visit(a):
        if isinstance(a, fx.Node):
            m = a.meta.get(META)
            if not isinstance(m, TensorMeta):
                raise _Skip
            return ("T", tuple(m.shape), str(m.dtype), bool(needs_grad(a) and m.dtype.is_floating_point))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__,) + tuple(visit(x) for x in a)
        if isinstance(a, dict):
            return ("dict",) + tuple((k, visit(v)) for k, v in sorted(a.items()))
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                          torch.layout)):
            return a
        raise _Skip

    try:
        parts.append(visit(node.args))
        parts.append(visit(node.kwargs))
    except _Skip:
        return None
    return (str(node.target),) + tuple(parts)


class _Skip(Exception):
    pass


def _materialize(a, inputs: list, needs_grad):
    if isinstance(a, fx.Node):
        m = a.meta[META]
        t = torch.empty(m.shape, dtype=m.dtype, device="meta")
        if needs_grad(a) and m.dtype.is_floating_point:
            t.requires_grad_(True)
            inputs.append(t)
        return t
    if isinstance(a, (list, tuple)):
        return type(a)(_materialize(x, inputs, needs_grad) for x in a)
    if isinstance(a, dict):
        return {k: _materialize(v, inputs, needs_grad) for k, v in a.items()}
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


def _run(node: fx.Node, needs_grad) -> int:
    inputs: list[torch.Tensor] = []
    args = _materialize(node.args, inputs, needs_grad)
    kwargs = _materialize(node.kwargs, inputs, needs_grad)
    if not inputs:
        return 0
    with torch.enable_grad():
        if op_facts(node.target).saved_as is not None and op_facts(node.target).attention:
            # attention's backward is the fused kernel's whatever its heads or dropout (no S x S
            # scores), as priced before op facts; the saved-tensor analysis keeps its stricter test
            out = fused_attention(**attention_call(args, kwargs))
        else:
            out = run_as_saved(node.target, args, kwargs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point]
        if not outs:
            return 0
        grad_outputs = [torch.empty_like(t) for t in outs]
        with _BackwardStorages() as mode:
            grads = torch.autograd.grad(outs, inputs, grad_outputs, allow_unused=True)
    final = {g.untyped_storage()._cdata for g in grads if g is not None}
    return max((sum(n for key, n in alive.items() if key not in final) for alive in mode.timeline), default=0)


def backward_workspace(node: fx.Node, needs_grad: Callable[[fx.Node], bool]) -> int:
    """Bytes (global shapes) the backward of ``node`` holds beyond the gradients it returns (module
    docstring). ``needs_grad(operand)``: whether the program differentiates that operand."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    key = _signature(node, needs_grad)
    if key is None:
        return 0
    if key not in _CACHE:
        try:
            _CACHE[key] = int(_run(node, needs_grad))
        except Exception:  # no meta kernel, no derivative, data-dependent shapes: nothing known, nothing added
            _CACHE[key] = 0
    return _CACHE[key]
