"""``aten.embedding(weight, indices, ...)``: output shape ``indices.shape + (D,)``.

Three ways to split one mesh axis:

- indices ``S(d)`` on any dim, weight ``R``: output ``S(d)`` (each rank looks up its own tokens);
- weight ``S(1)`` (the embedding dim), indices ``R``: output ``S(last)``;
- weight ``S(0)`` (vocabulary rows), indices ``R``: output ``P`` under the lowering
  ``"embedding_vocab"`` (a rank looks up the rows it owns and writes zeros for the rest).

With ``scale_grad_by_freq`` the weight gradient divides by each token's count in the batch, so
the strategies that split the batch of indices or the vocabulary (whose counts would be local)
are not offered.

Example, weight ``(8, 4)`` and indices ``(2, 3)``::

    (R, S(0))->(S(0))   (R, S(1))->(S(1))   (S(1), R)->(S(2))   (S(0), R)->(P)[embedding_vocab]
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten


@register_rule(aten.embedding.default)
def embedding_rule(call: OpCall) -> list[Strategy1D]:
    weight, indices = call.inputs
    local_counts = bool(call.bound_args["scale_grad_by_freq"])
    found: list[Strategy1D] = []
    if not local_counts:
        found += [Strategy1D((Replicate(), Shard(d)), (Shard(d),)) for d in range(len(indices.shape))]
    found.append(Strategy1D((Shard(1), Replicate()), (Shard(len(indices.shape)),)))
    if not local_counts:
        found.append(Strategy1D((Shard(0), Replicate()), (Partial(),), "embedding_vocab"))
    return found
