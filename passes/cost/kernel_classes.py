"""Memory-bound kernels priced per kernel class: the bytes each op moves and the fraction of the HBM
bandwidth its kind of kernel reaches.

A memory-bound op (anything that is not a matmul or attention kernel) costs ``bytes / (bandwidth x
memory_efficiency x class ratio)`` on hardware with the achievable-throughput model
(``kernels.achievable``); ``memory_efficiency`` is the hardware's streaming-copy fraction and each
class's ratio says how much slower its kernels run than a copy. ``memory_bound_price`` gives an op's
class and its forward and backward bytes:

- **bytes**: by default what the op reads and writes (its operands and outputs), forward and once more
  backward; ops whose kernels move something else have a rule here (``memory_bound_price``): a
  dropout writes its mask, a norm's backward reads the input again, a softmax over long rows reads
  its input several times, an embedding reads only the rows it gathers, a ``contiguous`` of a
  transposed view is a copy (of an already contiguous value, a no-op), a pointwise function's
  backward reads two tensors and writes one (1.5x), a product of two tensors' backward is a kernel
  per operand (2x);
- **custom ops** (a model's own fused kernels, ``torch.library`` ops) declare their class and bytes
  with ``register_kernel`` (``benchmarks/megatron_gpt_2021.py`` registers Megatron-LM's).

On hardware without that model (the CPU preset, a measured profile) every memory-bound op keeps the
plain pricing: operand + output bytes at the datasheet bandwidth, backward as the forward.

>>> CLASS_RATIO["copy"], round(CLASS_RATIO["elementwise"], 3)
(1.0, 0.791)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["CLASS_RATIO", "KernelCost", "register_kernel", "memory_bound_price", "KERNELS", "kernel_class",
           "class_seconds", "PROBE_RMSNORM_BYTES", "PROBE_ROPE_BYTES"]

#: The H100 probe (``benchmarks/gpu_fidelity_probe.py`` on one H100 SXM 80GB HBM3, torch 2.11 / CUDA 13,
#: 2026-11-25; ``benchmarks/gpu_fidelity_probe_h100.json``, "eager"): a 1 GiB ``copy_`` moved its 2 GiB
#: at 2.97 TB/s, 0.886 of the 3.35 TB/s datasheet bandwidth (the lead's calibration on another H100,
#: ``benchmarks/data/h100_calibration.json`` copy_table, 0.887 at 1 GiB); torchtitan's eager RMSNorm
#: forward (seven kernels: cast, pow, mean, add, rsqrt, mul, cast and the weight's mul; 36 bytes per
#: element) at 2.35 TB/s, 0.701; its complex RoPE forward (cast, complex multiply, cast back; 20 bytes
#: per element) at 2.51 TB/s, 0.750. A class's ratio is its kernels' rate over the copy's, measured in
#: the same run, so a device's own ``memory_efficiency`` (its copy rate) scales every class. The norm,
#: softmax and loss kernels are row reductions like the RMSNorm's mean and rsqrt and are taken at the
#: eager chain's rate (no separate measurement; an assumption). The rates are the kernels', not the
#: card's: the same ratios are used on A100 and H200 (an assumption: their copy rates are within 2%
#: of each other, BabelStream / the presets' ``memory_efficiency``).
_COPY, _EAGER_CHAIN, _ROPE = 0.886, 0.701, 0.750
#: the bytes per element those two eager chains move, counted from torchtitan's source (9dec370,
#: torchtitan/models/norms.py and llama/model.py): RMSNorm ``x.float()`` (2+4), ``pow(2)`` (4+4), ``mean``
#: (4), ``x * rsqrt`` (4+4), ``type_as`` (4+2), ``* weight`` (2+2); RoPE ``.float()`` (2+4), the complex
#: multiply (4+4), ``type_as`` (4+2). ``tests/passes/cost/test_measured_presets.py`` recomputes the
#: three rates above from the probe's file with them.
PROBE_RMSNORM_BYTES, PROBE_ROPE_BYTES = 36, 20
CLASS_RATIO = {
    "copy": 1.0,                       # copies, casts, contiguous of a transposed view, concatenation
    "elementwise": _EAGER_CHAIN / _COPY,  # eager pointwise kernels and reductions
    "norm": _EAGER_CHAIN / _COPY,      # layer / RMS / batch / group norm kernels
    "softmax": _EAGER_CHAIN / _COPY,   # softmax, log-softmax
    "loss": _EAGER_CHAIN / _COPY,      # cross entropy, nll
    "rope": _ROPE / _COPY,             # rotary embeddings computed on complex numbers
}

#: A softmax row of at most this many bytes is read from memory once: PyTorch's persistent (one warp per
#: row) kernel holds it in registers, and the block kernel's later passes over a row this small re-read
#: it from the SM's shared memory or L1 (aten/src/ATen/native/cuda/SoftMax.cu: ``cunn_SoftMaxForwardSmem``
#: when the row fits the block's 48 KiB of shared memory). A longer row (a vocabulary's logits: 51,200
#: fp32 values are 200 KiB) is streamed from memory once for the maximum, again for the sum of
#: exponentials and again to write the result (``cunn_SoftMaxForward``: ``ilpReduce`` twice, then
#: ``WriteFpropResults``); its backward reads the gradient (and, for softmax, the output) for the row's
#: sum, then both again to write the input's gradient (``cunn_SoftMaxBackward``).
CACHED_SOFTMAX_ROW_BYTES = 48 * 1024


@dataclass(frozen=True)
class KernelCost:
    """How a custom op's kernels run: its ``kernel_class`` (a key of ``CLASS_RATIO``) and optionally its
    forward / backward bytes as functions of ``(input metas, output metas)``; None: operand + output
    bytes (forward), the forward's again (backward)."""
    kernel_class: str
    fwd_bytes: Optional[Callable] = None
    bwd_bytes: Optional[Callable] = None


#: op (an OpOverload, its packet, or a qualified name "ns::op") -> KernelCost, filled by ``register_kernel``
KERNELS: dict = {}


def register_kernel(op, kernel_class: str, fwd_bytes: Optional[Callable] = None,
                    bwd_bytes: Optional[Callable] = None) -> None:
    """Declare how a (custom) memory-bound op is priced: its class and, if they are not its operand +
    output bytes, what its forward and backward kernels move (``f(inputs, outputs) -> bytes``, each a
    list of ``TensorMeta``)."""
    if kernel_class not in CLASS_RATIO:
        raise ValueError(f"kernel class {kernel_class!r}: choose one of {sorted(CLASS_RATIO)}")
    KERNELS[op] = KernelCost(kernel_class, fwd_bytes, bwd_bytes)


def _registered(target) -> Optional[KernelCost]:
    for key in (target, getattr(target, "overloadpacket", None), _qualified(target)):
        if key is not None and key in KERNELS:
            return KERNELS[key]
    return None


def _qualified(target) -> Optional[str]:
    name = getattr(getattr(target, "_schema", None), "name", None)  # "ns::op"
    return name


_COPIES = {"_to_copy", "to", "clone", "copy_", "copy", "type_as", "cat", "stack", "_unsafe_view_copy",
           "index_select", "repeat", "repeat_interleave", "roll", "flip"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
          "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
          "instance_norm"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_DROPOUT = {"dropout", "native_dropout", "feature_dropout"}
_TRANSPOSING_VIEWS = {"permute", "transpose", "t", "movedim", "swapaxes", "expand", "diagonal", "as_strided"}


def kernel_class(name: str, in_metas: list) -> str:
    """The class of an ATen op ``name`` without a registered cost."""
    if name in _COPIES or name == "contiguous":
        return "copy"
    if name in _NORMS:
        return "norm"
    if name in _SOFTMAX:
        return "softmax"
    if name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd"):
        return "loss"
    if name == "mul" and any(getattr(m.dtype, "is_complex", False) for m in in_metas):
        return "rope"
    return "elementwise"


def _bytes(metas) -> float:
    return float(sum(m.nbytes for m in metas))


def _row_bytes(node, x, dim=None) -> int:
    """Bytes of one row of ``x`` along the op's reduced dim (``dim``, else its second argument, else -1)."""
    if dim is None:
        dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else -1
    return (int(x.shape[dim]) if x.shape else 1) * x.dtype.itemsize


def memory_bound_price(node, name: str, in_metas: list, out_metas: list) -> tuple[str, float, float]:
    """(class, forward bytes, backward bytes) of memory-bound op ``node`` (ATen name ``name``): what its
    kernels read and write (module docstring); the backward's bytes are priced only when the op's output
    carries a gradient."""
    registered = _registered(node.target)
    moved = _bytes(in_metas) + _bytes(out_metas)
    if registered is not None:
        fwd = registered.fwd_bytes(in_metas, out_metas) if registered.fwd_bytes else moved
        bwd = registered.bwd_bytes(in_metas, out_metas) if registered.bwd_bytes else fwd
        return registered.kernel_class, float(fwd), float(bwd)
    cls = kernel_class(name, in_metas)
    if name == "contiguous":  # a copy only of a transposed (or expanded) view; else it returns its input
        src = node.args[0] if node.args else None
        copy = getattr(src, "op", None) == "call_function" and _op_name(src.target) in _TRANSPOSING_VIEWS
        return cls, (moved if copy else 0.0), (moved if copy else 0.0)
    if name in _DROPOUT and in_metas:  # the kept-element mask: one byte per element, written and read back
        mask = float(in_metas[0].numel)
        data = in_metas[0].nbytes + (out_metas[0].nbytes if out_metas else 0)
        return cls, data + mask, data + mask
    if name in _NORMS and in_metas:  # backward reads the input again next to the output's gradient
        return cls, moved, moved + in_metas[0].nbytes
    if name in _SOFTMAX and in_metas:
        x = in_metas[0]
        out = out_metas[0].nbytes if out_metas else x.nbytes
        if _row_bytes(node, x) <= CACHED_SOFTMAX_ROW_BYTES:
            return cls, x.nbytes + out, 2 * out + x.nbytes
        return cls, 3 * x.nbytes + out, (3 if "log" in name else 4) * out + x.nbytes
    if name == "cross_entropy_loss" and in_metas:  # log_softmax over the classes, then nll's gather
        x = in_metas[0]
        rest = moved - x.nbytes
        long_rows = bool(x.shape) and _row_bytes(node, x, 1 if len(x.shape) > 1 else 0) > CACHED_SOFTMAX_ROW_BYTES
        fwd = (4 if long_rows else 2) * x.nbytes + rest
        # nll's backward fills a zero gradient of the input's size and scatters into it, then the log_softmax
        # backward reads it and the saved output and writes the input's gradient
        bwd = x.nbytes + (4 if long_rows else 3) * x.nbytes
        return cls, fwd, bwd
    if name in ("nll_loss", "nll_loss_forward", "nll_loss_nd", "nll_loss2d") and len(in_metas) >= 2:
        x, t = in_metas[0], in_metas[1]
        gathered = t.numel * x.dtype.itemsize  # one log-probability per target
        return cls, t.nbytes + gathered + _bytes(out_metas), x.nbytes + t.nbytes  # backward: a zero-filled gradient
    if name == "embedding" and len(in_metas) >= 2:  # reads only the rows it gathers
        weight, out = in_metas[0], (out_metas[0].nbytes if out_metas else 0)
        fwd = in_metas[1].nbytes + 2 * out
        # the weight's dense gradient: zero-filled, then the output's gradient added into its rows
        return cls, fwd, weight.nbytes + 2 * out + in_metas[1].nbytes
    if cls == "elementwise" and name in _UNARY_MATH and len(in_metas) == 1:
        # the backward reads the output's gradient and the input (or output) and writes the input's
        return cls, moved, 1.5 * moved
    if cls == "elementwise" and name in ("mul", "div") and len(in_metas) == 2 and all(
            m.numel == in_metas[0].numel for m in in_metas):
        # one backward kernel per operand, each reading the gradient and the other operand
        return cls, moved, 2.0 * moved
    return cls, moved, moved


#: pointwise functions of one tensor whose backward is one kernel reading two tensors and writing one
_UNARY_MATH = {"exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "pow",
               "reciprocal", "erf", "softplus", "mish", "elu", "leaky_relu", "hardswish", "hardsigmoid", "square",
               "abs", "neg"}


def _op_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def class_seconds(hw, kernel_class_name: str, nbytes: float) -> float:
    """Seconds of ``nbytes`` moved by kernels of ``kernel_class_name`` on ``hw`` (achievable model)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (hw.memory_bandwidth * hw.memory_efficiency * CLASS_RATIO[kernel_class_name])
