"""How each ATen op without FLOPs runs on the device: its memory-bound kernel class, the bytes its forward and
backward kernels move when that is not its operand + output bytes, and whether it is a view, a call with no
dispatch, or an op whose output carries no gradient. Registered as ``OpFacts`` (``passes/op_facts.py``)
keyed by the op's packet (every overload), as the rules are; the cost model
(``passes/cost/kernel_classes.py``, ``passes/cost/facts.py``) reads only these facts.

The byte rules (what the kernels read and write; the sources are cited at each rule):

- a dropout writes its kept-element mask (one byte per element) and reads it back in backward;
- a norm's backward reads the input again next to the output's gradient;
- a softmax over a row longer than ``CACHED_SOFTMAX_ROW_BYTES`` reads its input several times;
- cross entropy is a log_softmax over the classes, then nll's gather; nll reads one value per target;
- an embedding reads only the rows it gathers; its backward fills the weight's dense gradient;
- a ``contiguous`` of a transposed (or expanded) view is a copy, of any other value a no-op;
- a pointwise function of one tensor: its backward reads two tensors and writes one (1.5x);
- a product or quotient of two same-sized tensors: one backward kernel per operand (2x).

May import: torch and the ``passes`` vocabulary (``graph``, ``op_facts``).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch

from autoshard.passes.graph import operand_meta, operands, outputs
from autoshard.passes.op_facts import OpFacts, op_facts, register_facts

__all__ = ["CACHED_SOFTMAX_ROW_BYTES"]

aten = torch.ops.aten

#: A softmax row of at most this many bytes is read from memory once: PyTorch's persistent (one warp per
#: row) kernel holds it in registers, and the block kernel's later passes over a row this small re-read
#: it from the SM's shared memory or L1 (aten/src/ATen/native/cuda/SoftMax.cu: ``cunn_SoftMaxForwardSmem``
#: when the row fits the block's 48 KiB of shared memory). A longer row (a vocabulary's logits: 51,200
#: fp32 values are 200 KiB) is streamed from memory once for the maximum, again for the sum of
#: exponentials and again to write the result (``cunn_SoftMaxForward``: ``ilpReduce`` twice, then
#: ``WriteFpropResults``); its backward reads the gradient (and, for softmax, the output) for the row's
#: sum, then both again to write the input's gradient (``cunn_SoftMaxBackward``).
CACHED_SOFTMAX_ROW_BYTES = 48 * 1024


def _packets(*names: str) -> list:
    """The ATen packets of ``names`` that this torch has (an op it lacks cannot be in a graph)."""
    return [p for p in (getattr(aten, n, None) for n in names) if p is not None]


def _bytes(metas) -> float:
    return float(sum(m.nbytes for m in metas))


def _row_bytes(node, x, dim=None) -> int:
    """Bytes of one row of ``x`` along the op's reduced dim (``dim``, else its second argument, else -1)."""
    if dim is None:
        dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else -1
    return (int(x.shape[dim]) if x.shape else 1) * x.dtype.itemsize


def _same_as_operand(node) -> bool:
    """``x.to(x.dtype)`` returns ``x`` itself."""
    ops = operands(node)
    return len(ops) == 1 and outputs(node) == [operand_meta(ops[0])]


def _identity_dropout(node) -> bool:
    """``dropout(x, p=0)`` (or not training) returns ``x`` itself: ATen's ``dropout`` takes the fused
    kernel only for ``0 < p < 1`` and otherwise ``_dropout_impl`` returns its input when ``p == 0 or
    not train`` (aten/src/ATen/native/Dropout.cpp), so it owns no storage and autograd records no node."""
    if len(node.args) < 3:
        return False
    p, train = node.args[1], node.args[2]
    return isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train)


def _contiguous_bytes(node, ins, outs) -> tuple[float, float]:
    """A copy only of a transposed (or expanded) view; else it returns its input."""
    src = node.args[0] if node.args else None
    copy = getattr(src, "op", None) == "call_function" and op_facts(src.target).transposing
    moved = _bytes(ins) + _bytes(outs) if copy else 0.0
    return moved, moved


def _dropout_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """The kept-element mask: one byte per element, written and read back."""
    if not ins:
        return None
    data = ins[0].nbytes + (outs[0].nbytes if outs else 0)
    return data + float(ins[0].numel), data + float(ins[0].numel)


def _norm_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """The backward reads the input again next to the output's gradient."""
    if not ins:
        return None
    moved = _bytes(ins) + _bytes(outs)
    return moved, moved + ins[0].nbytes


def _softmax_bytes(backward_reads: int):
    """A softmax's bytes (module docstring); a long row's backward reads ``backward_reads`` times the output
    (4 for softmax, which re-reads its output; 3 for log_softmax)."""
    def rule(node, ins, outs) -> Optional[tuple[float, float]]:
        if not ins:
            return None
        x = ins[0]
        out = outs[0].nbytes if outs else x.nbytes
        if _row_bytes(node, x) <= CACHED_SOFTMAX_ROW_BYTES:
            return x.nbytes + out, 2 * out + x.nbytes
        return 3 * x.nbytes + out, backward_reads * out + x.nbytes
    return rule


def _cross_entropy_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """log_softmax over the classes, then nll's gather."""
    if not ins:
        return None
    x = ins[0]
    rest = _bytes(ins) + _bytes(outs) - x.nbytes
    long_rows = bool(x.shape) and _row_bytes(node, x, 1 if len(x.shape) > 1 else 0) > CACHED_SOFTMAX_ROW_BYTES
    fwd = (4 if long_rows else 2) * x.nbytes + rest
    # nll's backward fills a zero gradient of the input's size and scatters into it, then the log_softmax
    # backward reads it and the saved output and writes the input's gradient
    return fwd, x.nbytes + (4 if long_rows else 3) * x.nbytes


def _nll_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """One log-probability read per target; backward: a zero-filled gradient of the input."""
    if len(ins) < 2:
        return None
    x, t = ins[0], ins[1]
    return t.nbytes + t.numel * x.dtype.itemsize + _bytes(outs), x.nbytes + t.nbytes


def _embedding_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """Reads only the rows it gathers; backward: the weight's dense gradient, zero-filled, then the output's
    gradient added into its rows."""
    if len(ins) < 2:
        return None
    weight, out = ins[0], (outs[0].nbytes if outs else 0)
    return ins[1].nbytes + 2 * out, weight.nbytes + 2 * out + ins[1].nbytes


def _unary_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """The backward reads the output's gradient and the input (or output) and writes the input's."""
    if len(ins) != 1:
        return None
    moved = _bytes(ins) + _bytes(outs)
    return moved, 1.5 * moved


def _complex(ins) -> bool:
    return any(getattr(m.dtype, "is_complex", False) for m in ins)


def _product_bytes(node, ins, outs) -> Optional[tuple[float, float]]:
    """One backward kernel per operand, each reading the gradient and the other operand (a product of
    complex tensors is a RoPE kernel, priced plainly)."""
    if len(ins) != 2 or _complex(ins) or any(m.numel != ins[0].numel for m in ins):
        return None
    moved = _bytes(ins) + _bytes(outs)
    return moved, 2.0 * moved


_VIEW = OpFacts(view=True)
_TRANSPOSING_VIEW = OpFacts(view=True, transposing=True)

register_facts(*_packets("view", "_unsafe_view", "reshape", "_reshape_alias", "expand_as", "squeeze", "unsqueeze",
                         "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow", "alias",
                         "view_as", "flatten", "unflatten", "lift_fresh", "view_as_real", "view_as_complex"),
               facts=_VIEW)
register_facts(*_packets("transpose", "t", "permute", "expand", "diagonal", "as_strided", "movedim"),
               facts=_TRANSPOSING_VIEW)
register_facts(*_packets("swapaxes"), facts=OpFacts(transposing=True))
register_facts(*_packets("sym_size", "sym_numel"), facts=OpFacts(view=True, free_call=True))
register_facts(operator.getitem, facts=OpFacts(view=True, free_call=True))
register_facts(*_packets("_assert_tensor_metadata"), facts=OpFacts(view=True, free_call=True, no_grad=True))
register_facts(*_packets("detach"), facts=OpFacts(view=True, no_grad=True))
register_facts(*_packets("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "argmax",
                         "argmin", "arange", "zeros", "ones", "empty", "full", "scalar_tensor", "lift_fresh_copy"),
               facts=OpFacts(no_grad=True))

register_facts(*_packets("_to_copy", "clone", "copy_", "copy", "type_as", "cat", "stack", "_unsafe_view_copy",
                         "index_select", "repeat", "repeat_interleave", "roll", "flip"),
               facts=OpFacts(kernel_class="copy"))
register_facts(aten.to, facts=OpFacts(kernel_class="copy", view=_same_as_operand))
register_facts(aten.contiguous, facts=OpFacts(kernel_class="copy", memory_bytes=_contiguous_bytes))
register_facts(*_packets("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
                         "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                         "_native_batch_norm_legit_functional", "instance_norm"),
               facts=OpFacts(kernel_class="norm", memory_bytes=_norm_bytes))
register_facts(*_packets("softmax", "_softmax", "_safe_softmax"),
               facts=OpFacts(kernel_class="softmax", memory_bytes=_softmax_bytes(4)))
register_facts(*_packets("log_softmax", "_log_softmax"),
               facts=OpFacts(kernel_class="softmax", memory_bytes=_softmax_bytes(3)))
register_facts(aten.cross_entropy_loss, facts=OpFacts(kernel_class="loss", memory_bytes=_cross_entropy_bytes))
register_facts(*_packets("nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd"),
               facts=OpFacts(kernel_class="loss", memory_bytes=_nll_bytes))
register_facts(aten.dropout, facts=OpFacts(memory_bytes=_dropout_bytes, view=_identity_dropout))
register_facts(*_packets("native_dropout", "feature_dropout"), facts=OpFacts(memory_bytes=_dropout_bytes))
register_facts(aten.embedding, facts=OpFacts(memory_bytes=_embedding_bytes))
register_facts(*_packets("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu",
                         "pow", "reciprocal", "erf", "softplus", "mish", "elu", "leaky_relu", "hardswish",
                         "hardsigmoid", "square", "abs", "neg"),
               facts=OpFacts(memory_bytes=_unary_bytes))
register_facts(aten.mul, facts=OpFacts(kernel_class=lambda ins: "rope" if _complex(ins) else "elementwise",
                                       memory_bytes=_product_bytes))
register_facts(aten.div, facts=OpFacts(memory_bytes=_product_bytes))
