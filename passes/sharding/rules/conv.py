"""Convolutions (plain and transposed, 1-3 spatial dims) as the training IR records them.

Input ``(N, Cin, *spatial)`` (or unbatched ``(Cin, *spatial)``); weight ``(Cout, Cin/groups, *k)``,
or ``(Cin, Cout/groups, *k)`` for a transposed convolution; bias ``(Cout,)``.

- batch: input ``S(0)``, weight and bias ``R`` -> output ``S(0)``;
- output channels (groups == 1): input ``R``, weight split on its Cout dim (``S(0)``; transposed
  ``S(1)``), bias ``S(0)`` -> output split on its channel dim;
- input channels (groups == 1): input split on its channel dim, weight on its Cin dim (``S(1)``;
  transposed ``S(0)``) -> output ``P``; bias ``P`` too, so it is added once in the sum.

Grouped convolutions only split the batch: a rank holding a slice of the channels would need a
different ``groups`` argument, which local execution does not rewrite.

Example, ``conv2d(x (4, 3, 8, 8), w (6, 3, 3, 3), b (6,))``::

    (S(0), R, R)->(S(0))   (R, S(0), S(0))->(S(1))   (S(1), S(1), P)->(P)

Op facts (``passes/op_facts.py``): the plain convolutions are compute-bound, ``2 * output elements *
Cin/groups * kernel size`` FLOPs; ``convolution``/``_convolution`` are also the dispatch-level kernels
whose outputs selective checkpointing keeps. The transposed ones are still priced as memory-bound.
"""
from __future__ import annotations

import math

import torch

from autoshard.passes.op_facts import OpFacts, register_facts
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten

_TRANSPOSED = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}


def _transposed(call: OpCall) -> bool:
    if call.target in _TRANSPOSED:
        return True
    if call.target in (aten.convolution.default, aten._convolution.default, aten._convolution.deprecated):
        return bool(call.bound_args["transposed"])
    return False


def _strategy(names: list[str], by_name: dict[str, Placement], out: Placement) -> Strategy1D:
    return Strategy1D(tuple(by_name[n] for n in names), (out,))


@register_rule(aten.convolution.default, aten._convolution.default, aten._convolution.deprecated,
               aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
               aten.conv3d.default, aten.conv3d.padding,
               aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
def conv_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    x = call.inputs[names.index("input")].shape
    w = call.inputs[names.index("weight")].shape
    batched = len(x) == len(w)
    channel = 1 if batched else 0
    found = []
    if batched:
        found.append(_strategy(names, {"input": Shard(0), "weight": Replicate(), "bias": Replicate()}, Shard(0)))
    if int(call.bound_args["groups"]) == 1:
        cout, cin = (1, 0) if _transposed(call) else (0, 1)
        found.append(_strategy(names, {"input": Replicate(), "weight": Shard(cout), "bias": Shard(0)},
                               Shard(channel)))
        found.append(_strategy(names, {"input": Shard(channel), "weight": Shard(cin), "bias": Partial()},
                               Partial()))
    return found


def conv_flops(call: OpCall) -> float:
    """2 * output elements * the weight's per-output-channel size (``Cin/groups * kernel``)."""
    return 2.0 * call.outputs[0].numel * math.prod(call.inputs[1].shape[1:])


register_facts(aten.convolution.default, aten._convolution.default, aten._convolution.deprecated,
               facts=OpFacts(flops=conv_flops, selective_save=True))
register_facts(aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
               aten.conv3d.default, aten.conv3d.padding, facts=OpFacts(flops=conv_flops))
