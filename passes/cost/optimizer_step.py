"""What a step costs per parameter element outside the program: the optimizer's update and the gradient
accumulation between microbatches. Both are memory-bound passes over the local shard of every
parameter (``CostModel.param_step_seconds``).

- **optimizer step** (``optimizer_step_bytes``): the bytes one step's kernels read and write per
  element, for parameters stored with ``itemsize`` bytes (the fp32 masters under mixed precision);
- **gradient accumulation** (``accumulation_bytes``): every microbatch after the first adds its
  gradient into the stored one (autograd's ``AccumulateGrad``: an in-place add), reading the new
  gradient (the compute dtype) and the stored one and writing it back.

>>> optimizer_step_bytes("adamw", 4), optimizer_step_bytes("sgd", 4), optimizer_step_bytes("megatron_adam", 2)
(80.0, 12.0, 60.0)
>>> accumulation_bytes(2, 2), accumulation_bytes(2, 4)   # fp16 into fp16 .grad; bf16 into fp32 masters
(6.0, 10.0)
"""
from __future__ import annotations

from typing import Union

__all__ = ["optimizer_step_bytes", "accumulation_bytes", "MEGATRON_ADAM_STEP_BYTES"]

#: torch.optim.AdamW as constructed by default: on CUDA tensors ``foreach`` (torch/optim/optimizer.py,
#: ``_default_to_fused_or_foreach``), ``_multi_tensor_adamw``'s kernels per element, in units of the
#: parameter's itemsize: ``_foreach_mul_`` (weight decay: read, write: 2), ``_foreach_lerp_`` (exp_avg and
#: the gradient read, exp_avg written: 3), ``_foreach_mul_`` (exp_avg_sq: 2), ``_foreach_addcmul_``
#: (exp_avg_sq, the gradient twice, written: 3 as one read of the gradient), ``_foreach_sqrt`` (2),
#: ``_foreach_div_`` (2), ``_foreach_add_`` (2), ``_foreach_addcdiv_`` (parameter, exp_avg, denominator,
#: written: 4) = 20 (80 bytes per fp32 parameter).
_ADAMW_FOREACH = 20.0
#: SGD without momentum: ``param.add_(grad, alpha=-lr)``: read both, write one (3); with momentum the
#: buffer's ``mul_`` and ``add_`` (2 + 3) come first (torch/optim/sgd.py, ``_multi_tensor_sgd``): 8.
_SGD, _SGD_MOMENTUM = 3.0, 8.0
#: Megatron-LM's mixed-precision Adam (``Float16OptimizerWithFloat16Params``, megatron/optimizer/
#: optimizer.py, April 2021, with apex's multi-tensor kernels) on a 16-bit model, bytes per element: the
#: 16-bit gradients copied into the fp32 main gradients (2 + 4), unscaled with the inf check (4 + 4), the
#: gradient norm and the clip (4, then 4 + 4), apex FusedAdam on the fp32 main parameter, gradient and
#: moments (28), the fp32 main parameters copied back to the 16-bit model (4 + 2).
MEGATRON_ADAM_STEP_BYTES = 6 + 8 + 12 + 28 + 6


def optimizer_step_bytes(optimizer: Union[str, float, int], itemsize: int) -> float:
    """Bytes one optimizer step moves per parameter element stored with ``itemsize`` bytes (module
    docstring). A number (the optimizer's state bytes per element) is priced as reading and writing
    the parameter and every state once and reading the gradient: ``3 * itemsize + 2 * state``."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        return 3.0 * itemsize + 2.0 * float(optimizer)
    key = str(optimizer).lower()
    if key in ("adamw", "adam"):
        return _ADAMW_FOREACH * itemsize
    if key == "megatron_adam":
        return float(MEGATRON_ADAM_STEP_BYTES)
    if key == "sgd":
        return _SGD * itemsize
    if key in ("sgd_momentum", "momentum"):
        return _SGD_MOMENTUM * itemsize
    return 0.0  # "none", "adafactor": no model of their step


def accumulation_bytes(compute_itemsize: int, stored_itemsize: int) -> float:
    """Bytes per element one gradient accumulation moves: the new gradient read, the stored one read
    and written."""
    return float(compute_itemsize + 2 * stored_itemsize)
