"""``operator.getitem`` on a multi-output op: the selected output keeps its placement."""
from __future__ import annotations

from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall


def getitem_rule(call: OpCall) -> list[Strategy1D]:
    (meta,) = call.inputs
    options = [Partial()] + [Shard(d) for d in range(len(meta.shape))]
    return [Strategy1D((p,), (p,)) for p in options]
