"""Upsampling: interpolation (``F.interpolate``, ``nn.Upsample``) and pixel (un)shuffle.

Interpolation (``upsample_nearest{1,2,3}d``, ``_upsample_nearest_exact{1,2,3}d``,
``upsample_linear1d``, ``upsample_bilinear2d``, ``upsample_bicubic2d``, ``upsample_trilinear3d``,
the antialiased ``_upsample_{bilinear,bicubic}2d_aa``; their ``.vec`` and ``.default`` overloads):
each (batch, channel) plane is resampled on its own, so every dim before the trailing spatial ones
shards freely, ``S(d) -> S(d)``. Every mode is linear in the input (a fixed weighted sum of input
pixels), so ``P -> P``. Spatial dims do not shard: an output pixel near a shard edge reads input
pixels of the neighbouring shard, and the op's ``output_size`` argument is the global size.

Pixel shuffle ``(*, C r^2, H, W) -> (*, C, H r, W r)`` and unshuffle (the inverse) only move
elements: leading dims shard freely; the channel dim shards too (output channel block ``k`` is
made of input channel block ``k``, of ``r^2`` times the size: divisibility of the smaller side is
checked for both tensors), and so do ``H`` and ``W`` (row block ``k`` of the input makes row block
``k`` of the output). A permutation is linear: ``P -> P``.

Example, ``upsample_nearest2d(x (4, 8, 16, 16))``::

    (S(0))->(S(0))   (S(1))->(S(1))   (P)->(P)
"""
from __future__ import annotations

import torch

from autoshard.passes.sharding.rules.common import split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule
from autoshard.passes.spec import Partial, Shard, Strategy1D

aten = torch.ops.aten

# op name -> number of trailing spatial dims
_INTERPOLATIONS = {
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2, "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_bicubic2d": 2, "upsample_trilinear3d": 3,
    "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2,
}


def _overloads(name: str) -> list:
    """The forward overloads of ``aten.<name>`` this torch build has (``.vec``, ``.default``)."""
    packet = getattr(aten, name, None)
    return [getattr(packet, o) for o in ("vec", "default") if packet is not None and hasattr(packet, o)]


def _interpolation_rule(spatial: int):
    def rule(call: OpCall) -> list[Strategy1D]:
        x = call.inputs[0].shape
        planes = [d for d in split_dims(x) if d < len(x) - spatial]
        return [Strategy1D((Shard(d),), (Shard(d),)) for d in planes] + [Strategy1D((Partial(),), (Partial(),))]
    return rule


for _name, _spatial in _INTERPOLATIONS.items():
    if _overloads(_name):
        register_rule(*_overloads(_name), float_partials_only=True)(_interpolation_rule(_spatial))


@register_rule(aten.pixel_shuffle.default, aten.pixel_unshuffle.default, float_partials_only=True)
def pixel_shuffle_rule(call: OpCall) -> list[Strategy1D]:
    x, y = call.inputs[0].shape, call.outputs[0].shape
    dims = [d for d in range(len(x)) if x[d] > 1 and y[d] > 1]
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in dims] + [Strategy1D((Partial(),), (Partial(),))]
