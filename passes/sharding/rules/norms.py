"""Normalisation layers: layer/RMS norm, batch norm, group norm.

- ``layer_norm`` / ``native_layer_norm`` / ``rms_norm`` / ``_fused_rms_norm``: any dim *before*
  the normalised ones may be split; weight and bias stay ``R``; every output (the saved
  mean/rstd too) is split on the same dim.
- batch norm (``batch_norm``, ``native_batch_norm``, ``_native_batch_norm_legit*``):
  channel dim 1 split with weight, bias and running stats ``S(0)`` (per-channel statistics stay
  local); batch or spatial dims split with per-channel tensors ``R`` -- in training this needs
  the global-batch statistics, lowering ``"batch_norm_sync"``; in eval mode (running stats
  used) it runs as is.
- ``group_norm``: batch dim 0 split, weight and bias ``R``. (``native_group_norm`` takes the batch
  size ``N`` as an argument, which local execution would have to rewrite, so it has no rule.)

Example, ``layer_norm(x (4, 6, 8), [8], w, b)``::

    (S(0), R, R)->(S(0))   (S(1), R, R)->(S(1))
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Placement, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten

def _split_like(shape: tuple, ref: tuple, d: int) -> Placement:
    """``S(d)`` for an output that carries dim d of the input (same size there), else ``R``."""
    return Shard(d) if len(shape) == len(ref) and shape[d] == ref[d] else Replicate()


@register_rule(aten.layer_norm.default, aten.native_layer_norm.default,
               aten.rms_norm.default, aten._fused_rms_norm.default)
def layer_norm_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    x = call.inputs[names.index("input")].shape
    leading = len(x) - len(call.bound_args["normalized_shape"])
    found = []
    for d in range(leading):
        ins = tuple(Shard(d) if n == "input" else Replicate() for n in names)
        found.append(Strategy1D(ins, tuple(_split_like(o.shape, x, d) for o in call.outputs)))
    return found


def _training(call: OpCall) -> bool:
    if call.target == aten._native_batch_norm_legit_no_training.default:
        return False
    return bool(call.bound_args["training"])


@register_rule(aten.batch_norm.default, aten.native_batch_norm.default,
               aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
               aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default)
def batch_norm_rule(call: OpCall) -> list[Strategy1D]:
    """Operands: input, then per-channel weight/bias/running stats (those not None).

    Outputs: the normalised tensor (like input), then per-channel tensors (or empty ones).
    """
    names = call.operand_names()
    x = call.inputs[names.index("input")].shape
    if len(x) < 2:
        return []
    channels = x[1]
    found = []
    ins = tuple(Shard(1) if n == "input" else Shard(0) for n in names)
    outs = (Shard(1),) + tuple(Shard(0) if o.shape == (channels,) else Replicate() for o in call.outputs[1:])
    found.append(Strategy1D(ins, outs))
    lowering = "batch_norm_sync" if _training(call) else None
    for d in [0, *range(2, len(x))]:
        ins = tuple(Shard(d) if n == "input" else Replicate() for n in names)
        outs = (Shard(d),) + tuple(Replicate() for _ in call.outputs[1:])
        found.append(Strategy1D(ins, outs, lowering))
    return found


@register_rule(aten.group_norm.default)
def group_norm_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    x = call.inputs[names.index("input")].shape
    if len(x) < 2:
        return []
    ins = tuple(Shard(0) if n == "input" else Replicate() for n in names)
    return [Strategy1D(ins, (Shard(0),))]
