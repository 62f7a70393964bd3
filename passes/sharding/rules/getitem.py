"""``operator.getitem`` on a multi-output op: the selected output keeps its placement.

Its one operand is the selected output (``passes.graph.operands``), so any split of it, or ``P``,
passes through unchanged: ``(S(d))->(S(d))`` for each dim, and ``(P)->(P)``.
"""
from __future__ import annotations

import operator

from autoshard.passes.spec import Partial, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

__all__ = ["getitem_rule"]


@register_rule(operator.getitem)
def getitem_rule(call: OpCall) -> list[Strategy1D]:
    (meta,) = call.inputs
    options = [Partial()] + [Shard(d) for d in range(len(meta.shape))]
    return [Strategy1D((p,), (p,)) for p in options]
