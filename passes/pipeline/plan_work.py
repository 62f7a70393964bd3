"""What a plan's step time means for the user: tokens (or samples) per second per device, and MFU.

Conventions (every plan summary uses these):

- **Model FLOPs** per step: the captured program's matmul-like ops (mm, addmm, bmm, linear, einsum,
  convolution, scaled-dot-product attention, MoE experts' routed GEMMs), 2 FLOPs per multiply-add,
  counted as the cost model counts them (``passes.cost.facts.matmul_flops``: attention in full, no
  causal halving), times 3
  for a training step (forward, and the backward's input- and weight-gradient matmuls) or 1 for a
  forward-only program (no loss). Recomputation is NOT counted: this is MFU, not hardware FLOPs
  utilization. Element-wise ops, norms and the optimizer are not counted.
- **Tokens** per step: the element count of the first integer-typed user input with two or more
  dimensions (token ids, batch x sequence); a program without one reports **samples** (dim 0 of
  its first input).
- **Peak**: the hardware's dense peak per device (``Hardware.peak_flops``) for the dtype the
  matmuls run in: the mixed-precision compute dtype when the plan casts, else the dtype carrying
  most of the model FLOPs.
- **MFU** = model FLOPs / (estimated step time x devices x peak).

>>> work = ModelWork(flops=6e15, tokens=8192, samples=4, peak_flops=1e15, devices=8)
>>> work.rate(1.0), work.rate_unit, round(work.mfu(1.0), 3)
(1024.0, 'tokens', 0.75)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

import torch

from autoshard.passes.cost.facts import matmul_flops
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import AutoshardError
from autoshard.passes.graph import META, CapturedGraph, outputs
from autoshard.passes.spec import TensorMeta

__all__ = ["ModelWork", "model_work", "plan_work", "hardware_label"]


@dataclass(frozen=True)
class ModelWork:
    """One step's useful work (see the module docstring): ``flops`` over all devices, ``tokens``
    (None when the inputs carry no token ids), ``samples``, the per-device ``peak_flops``, the
    number of ``devices`` sharing the step, and whether it is a ``training`` step (FLOPs x3)."""
    flops: float
    tokens: Optional[int]
    samples: int
    peak_flops: float
    devices: int
    training: bool = True

    @property
    def rate_unit(self) -> str:
        return "tokens" if self.tokens else "samples"

    def rate(self, step_time: float) -> Optional[float]:
        """Tokens (or samples) per second per device at ``step_time`` seconds a step."""
        if not step_time or step_time <= 0:
            return None
        return (self.tokens or self.samples) / step_time / self.devices

    def samples_rate(self, step_time: float) -> Optional[float]:
        """Samples (rows of the global batch) per second per device at ``step_time`` seconds a step."""
        if not step_time or step_time <= 0:
            return None
        return self.samples / step_time / self.devices

    def mfu(self, step_time: float) -> Optional[float]:
        """Model FLOPs utilization at ``step_time`` seconds a step (0..1)."""
        if not step_time or step_time <= 0 or self.peak_flops <= 0:
            return None
        return self.flops / (step_time * self.devices * self.peak_flops)

    def to_json(self) -> dict:
        return {"flops": self.flops, "tokens": self.tokens, "samples": self.samples, "peak_flops": self.peak_flops,
                "devices": self.devices, "training": self.training}

    @classmethod
    def from_json(cls, d: Optional[dict]) -> Optional["ModelWork"]:
        if not d:
            return None
        return cls(float(d["flops"]), None if d.get("tokens") is None else int(d["tokens"]), int(d["samples"]),
                   float(d["peak_flops"]), int(d["devices"]), bool(d.get("training", True)))


def model_work(captured: CapturedGraph, hardware: Hardware, devices: int,
               compute_dtype: Optional[torch.dtype] = None) -> ModelWork:
    """The ``ModelWork`` of one step of ``captured`` on ``devices`` devices of ``hardware``.
    ``compute_dtype``: the dtype matmuls run in when the plan casts (mixed precision)."""
    flops_by_dtype: Counter = Counter()
    for node in captured.gm.graph.nodes:
        flops = matmul_flops(node)
        if flops:
            outs = [m for m in outputs(node) if m is not None]
            flops_by_dtype[outs[0].dtype] += flops
    forward = sum(flops_by_dtype.values())
    dtype = compute_dtype or (flops_by_dtype.most_common(1)[0][0] if flops_by_dtype else torch.float32)
    tokens, samples = None, None
    for name in captured.inputs:
        meta = captured.node(name).meta.get(META)
        if not isinstance(meta, TensorMeta) or not meta.shape:
            continue
        samples = samples or int(meta.shape[0])
        if tokens is None and len(meta.shape) >= 2 and not meta.dtype.is_floating_point and not meta.dtype.is_complex:
            tokens = int(meta.numel)
    training = captured.training  # a pipeline stage before the last trains too
    return ModelWork(forward * (3 if training else 1), tokens, samples or 1, hardware.peak_flops(dtype), devices,
                     training)


def hardware_label(hardware) -> str:
    """How a plan records its hardware: the preset or profile path, or a ``Hardware`` object's name."""
    return hardware if isinstance(hardware, str) else str(getattr(hardware, "name", "custom"))


def known_hardware(hardware) -> Optional[Hardware]:
    """A plan's ``hardware`` (its label: a preset name or a profile path, or a ``Hardware``) resolved,
    None when it names no hardware known here (a plan file written on another machine). Planning resolves
    its hardware once, in ``passes.solve.context.PlanContext``; this is the lookup for a plan's label."""
    try:
        return get_hardware(hardware)
    except AutoshardError:
        return None


def plan_work(captured: CapturedGraph, hardware, devices: int, levers=None) -> Optional[ModelWork]:
    """``model_work`` for a plan of ``captured`` on ``devices`` devices; the matmuls run in the
    mixed-precision compute dtype when ``levers`` (``passes.levers.Levers``) cast. None when
    ``hardware`` names no known hardware. ``captured`` is one of the ``levers.accumulation`` microsteps of
    a step (``plan_captured``'s contract), so the step's FLOPs, tokens and samples are that many times the
    program's."""
    hw = known_hardware(hardware)
    if hw is None:
        return None
    mp = getattr(levers, "mixed_precision", None)
    work = model_work(captured, hw, devices, compute_dtype=getattr(mp, "param_dtype", None))
    k = int(getattr(levers, "accumulation", 1) or 1)
    if k == 1:
        return work
    return replace(work, flops=work.flops * k, tokens=None if work.tokens is None else work.tokens * k,
                   samples=work.samples * k)
