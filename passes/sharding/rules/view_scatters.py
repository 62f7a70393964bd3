"""Sharding rules for the view scatters: ``slice_scatter``, ``select_scatter``.

``slice_scatter(self, src, dim, start, end, step)`` is ``self`` with ``self[dim: start:end:step]``
replaced by ``src`` (capture writes ``key[..., :d] = k_pass`` this way, see
``passes/capture/functionalize.py``). Every dim but ``dim`` shards, ``self``, ``src`` and the output
together (``select_scatter``'s ``src`` lacks ``dim``). The op is linear in ``(self, src)`` jointly,
so ``(P, P) -> P``.

>>> # slice_scatter(self: (8, 4, 16), src: (8, 4, 8), dim=2):  S(0): (S(0), S(0)) -> S(0);  S(1) likewise
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import norm_dim, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
P = Partial()

__all__ = ["view_scatter_rule"]


@register_rule(aten.slice_scatter.default, aten.select_scatter.default, float_partials_only=True)
def view_scatter_rule(call: OpCall) -> list[Strategy1D]:
    x, src = call.inputs
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    drops = call.target == aten.select_scatter.default
    found = []
    for d in split_dims(x.shape):
        if d != dim:
            found.append(Strategy1D((Shard(d), Shard(d - 1 if drops and d > dim else d)), (Shard(d),)))
    return found + [Strategy1D((P, P), (P,))]
