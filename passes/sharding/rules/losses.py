"""Loss functions: split the batch (element) dims of input and target alike.

What the output becomes depends on ``reduction`` (0 none, 1 mean, 2 sum):

- none: the per-element losses, split like the element dims;
- sum: ``P`` (each rank sums its elements);
- mean: ``P`` under the lowering ``"loss_mean_partial"`` (each rank divides its local sum by the
  GLOBAL count or total class weight).

Class losses (``cross_entropy_loss``, ``nll_loss*``): input ``(N, C, d1, ...)`` or ``(N, C)``;
the element dims are 0, 2, 3, ...; a class-index target ``(N, d1, ...)`` splits on the matching
dim (input dim k -> target dim k-1 for k >= 2), a class-probability target (shaped like input) on
the same dim. The class dim is never split; a class ``weight`` stays ``R``; unbatched ``(C,)``
input has no strategy. ``nll_loss*_forward`` also returns ``total_weight``: ``P`` for sum/mean.

Elementwise losses (``mse_loss``, ``l1_loss``, ``binary_cross_entropy_with_logits``): input and
target have one shape (the IR inserts ``broadcast_tensors`` first) and every dim of it is an
element dim; a ``weight`` / ``pos_weight`` that broadcasts over a dim stays ``R`` there.

Example, ``cross_entropy_loss(x (4, 5, 6), t (4, 6))``, reduction mean::

    (S(0), S(0))->(P)[loss_mean_partial]   (S(2), S(1))->(P)[loss_mean_partial]
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import broadcast_placement
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduced_outputs(call: OpCall, element_out: Placement) -> tuple[tuple[Placement, ...], str | None]:
    reduction = int(call.bound_args["reduction"])
    if reduction == _NONE:
        return (element_out,) + (Replicate(),) * (len(call.outputs) - 1), None
    lowering = "loss_mean_partial" if reduction == _MEAN else None
    return (Partial(),) * len(call.outputs), lowering


@register_rule(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
               aten.nll_loss2d.default, aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def class_loss_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    x = call.inputs[names.index("self")].shape
    t = call.inputs[names.index("target")].shape
    if len(x) < 2:
        return []
    soft = len(t) == len(x)
    found = []
    for k in [0, *range(2, len(x))]:
        tk = k if soft or k == 0 else k - 1
        ins = tuple(Shard(k) if n == "self" else Shard(tk) if n == "target" else Replicate() for n in names)
        outs, lowering = _reduced_outputs(call, Shard(0 if k == 0 else k - 1))
        found.append(Strategy1D(ins, outs, lowering))
    return found


@register_rule(aten.mse_loss.default, aten.l1_loss.default, aten.binary_cross_entropy_with_logits.default)
def elementwise_loss_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    shape = call.inputs[names.index("self")].shape
    if call.inputs[names.index("target")].shape != shape:
        return []  # the IR broadcasts first; the ATen kernels' gradients assume equal shapes
    found = []
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        ins = tuple(broadcast_placement(m, d, len(shape)) for m in call.inputs)
        outs, lowering = _reduced_outputs(call, Shard(d))
        found.append(Strategy1D(ins, outs, lowering))
    return found
