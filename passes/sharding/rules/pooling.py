"""Pooling: each (batch, channel) plane pools on its own, so those dims shard freely.

Spatial dims never shard (windows would cross shard edges). Average pooling is linear, so a
Partial input pools to a Partial output; max pooling is not.
"""
from __future__ import annotations

from torch.ops import aten

from autoshard.passes.spec import Partial, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

_SPATIAL = {"1d": 1, "2d": 2, "3d": 3}


def _plane_dims(call: OpCall, spatial: int) -> list[int]:
    """Batch and channel dims of the input: all dims before the trailing ``spatial`` ones."""
    return list(range(len(call.inputs[0].shape) - spatial))


def _pool(call: OpCall, spatial: int, linear: bool) -> list[Strategy1D]:
    n_out = len(call.outputs)
    out = [Strategy1D((Shard(d),), (Shard(d),) * n_out) for d in _plane_dims(call, spatial)]
    if linear:
        out.append(Strategy1D((Partial(),), (Partial(),) * n_out))
    return out


def _register(names, linear):
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        spatial = next(v for k, v in _SPATIAL.items() if k in name)
        targets = [getattr(packet, "default")] if hasattr(packet, "default") else []
        if targets:
            register_rule(*targets)(lambda call, s=spatial, lin=linear: _pool(call, s, lin))


_register(["max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"], linear=False)
_register(["avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d"], linear=True)
