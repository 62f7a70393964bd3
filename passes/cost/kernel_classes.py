"""Memory-bound kernels priced per kernel class: the bytes each op moves and the fraction of the HBM
bandwidth its kind of kernel reaches.

A memory-bound op (anything that is not a matmul or attention kernel) costs ``bytes / (bandwidth x
memory_efficiency x class ratio)`` on hardware with the achievable-throughput model
(``kernels.achievable``); ``memory_efficiency`` is the hardware's streaming-copy fraction and each
class's ratio says how much slower its kernels run than a copy. ``memory_bound_price`` gives an op's
class and its forward and backward bytes:

- **class and bytes** are the op's ``OpFacts`` (``passes/op_facts.py``), registered for ATen ops in
  ``passes/sharding/rules/kernel_facts.py`` beside the sharding rules: by default an op is
  ``elementwise`` and moves what it reads and writes (its operands and outputs), forward and once more
  backward; ops whose kernels move something else have a byte rule there: a
  dropout writes its mask, a norm's backward reads the input again, a softmax over long rows reads
  its input several times, an embedding reads only the rows it gathers, a ``contiguous`` of a
  transposed view is a copy (of an already contiguous value, a no-op), a pointwise function's
  backward reads two tensors and writes one (1.5x), a product of two tensors' backward is a kernel
  per operand (2x);
- **custom ops** (a model's own fused kernels, ``torch.library`` ops) declare their class and bytes
  with ``register_facts`` or its shorthand ``register_kernel`` here (``benchmarks/megatron_gpt_2021.py``
  registers Megatron-LM's). No op is recognised by its name.

On hardware without that model (the CPU preset, a measured profile) every memory-bound op keeps the
plain pricing: operand + output bytes at the datasheet bandwidth, backward as the forward.

>>> CLASS_RATIO["copy"], round(CLASS_RATIO["elementwise"], 3)
(1.0, 0.791)
"""
from __future__ import annotations

from typing import Callable, Optional

from autoshard.passes.op_facts import OpFacts, op_facts, register_facts
from autoshard.passes.sharding.rules.kernel_facts import CACHED_SOFTMAX_ROW_BYTES

__all__ = ["CLASS_RATIO", "CACHED_SOFTMAX_ROW_BYTES", "register_kernel", "memory_bound_price", "class_seconds",
           "PROBE_RMSNORM_BYTES", "PROBE_ROPE_BYTES"]

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

def register_kernel(op, kernel_class: str, fwd_bytes: Optional[Callable] = None,
                    bwd_bytes: Optional[Callable] = None) -> None:
    """Declare how a (custom) memory-bound op is priced: its class and, if they are not its operand +
    output bytes, what its forward and backward kernels move (``f(inputs, outputs) -> bytes``, each a
    list of ``TensorMeta``; the backward defaults to the forward's). Records ``OpFacts`` for ``op`` (an
    overload, a packet or a qualified name ``"ns::op"``): the same as ``register_facts(op,
    facts=OpFacts(kernel_class=..., memory_bytes=...))`` beside the op's rule."""
    if kernel_class not in CLASS_RATIO:
        raise ValueError(f"kernel class {kernel_class!r}: choose one of {sorted(CLASS_RATIO)}")

    def moved(node, ins, outs) -> tuple[float, float]:
        fwd = fwd_bytes(ins, outs) if fwd_bytes else _bytes(ins) + _bytes(outs)
        return float(fwd), float(bwd_bytes(ins, outs) if bwd_bytes else fwd)
    register_facts(op, facts=OpFacts(kernel_class=kernel_class, memory_bytes=moved))


def _bytes(metas) -> float:
    return float(sum(m.nbytes for m in metas))


def memory_bound_price(node, in_metas: list, out_metas: list) -> tuple[str, float, float]:
    """(class, forward bytes, backward bytes) of memory-bound op ``node``: its ``OpFacts`` kernel class and
    the bytes its kernels read and write (its byte rule, else operand + output bytes both ways); the
    backward's bytes are priced only when the op's output carries a gradient."""
    facts = op_facts(node.target)
    cls = facts.class_of(in_metas)
    if cls not in CLASS_RATIO:
        raise ValueError(f"op {node.target}: kernel class {cls!r} is none of {sorted(CLASS_RATIO)}")
    priced = facts.memory_bytes(node, in_metas, out_metas) if facts.memory_bytes is not None else None
    if priced is None:
        moved = _bytes(in_metas) + _bytes(out_metas)
        return cls, moved, moved
    return cls, float(priced[0]), float(priced[1])


def class_seconds(hw, kernel_class_name: str, nbytes: float) -> float:
    """Seconds of ``nbytes`` moved by kernels of ``kernel_class_name`` on ``hw`` (achievable model)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (hw.memory_bandwidth * hw.memory_efficiency * CLASS_RATIO[kernel_class_name])
