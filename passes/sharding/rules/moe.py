"""Sharding rule for ``autoshard::moe_experts`` (``passes/capture/moe_experts.py``): MoE experts.

Operands: ``hidden (T, H)``, ``top_k_index (T, k)``, ``top_k_weights (T, k)``, ``gate (E, I, H)``,
``up (E, I, H)``, ``down (E, H, I)``; output ``(T, H)``. Per mesh axis:

=====================  =====================================  ======  ==================
strategy               hidden, index, weights | gate, up, down  out     lowering
=====================  =====================================  ======  ==================
data parallel          S(0), S(0), S(0) | R, R, R               S(0)    -
tensor parallel (I)    R, R, R | S(1), S(1), S(2)               P       -
expert parallel        S(0), S(0), S(0) | S(0), S(0), S(0)      S(0)    expert_dispatch
expert parallel, local R, R, R | S(0), S(0), S(0)               P       expert_dispatch
=====================  =====================================  ======  ==================

With a capacity factor on the op (``capacity_factor`` > 0: static shapes), the two expert-parallel
strategies lower to ``expert_dispatch_capacity`` instead: every (rank, expert) exchange is padded to
the capacity and moved by an even all-to-all; pairs beyond it are dropped.

Expert parallel moves each (token, expert) pair to the rank holding its expert and back by
all-to-all (``runtime/moe_dispatch.py``); "local" keeps every token on every rank and lets each rank
compute only its own experts' pairs (no all-to-all; the output is summed like a row-parallel
matmul's). Over a 2-D mesh the per-axis choices combine: expert parallel on one axis with data or
tensor parallel on the other, or experts over both axes. Which one wins is the cost model's call
(``passes/cost/moe.py``: all-to-all time, compute under expert-load imbalance).
"""
from __future__ import annotations

from typing import Sequence

from autoshard.passes.op_facts import OpFacts
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

R, P, S0 = Replicate(), Partial(), Shard(0)

__all__ = ["moe_experts_rule", "moe_role", "moe_flops", "EXPERT_DISPATCH", "EXPERT_DISPATCH_CAPACITY", "DISPATCH_LOWERINGS"]

EXPERT_DISPATCH = "expert_dispatch"
EXPERT_DISPATCH_CAPACITY = "expert_dispatch_capacity"
DISPATCH_LOWERINGS = (EXPERT_DISPATCH, EXPERT_DISPATCH_CAPACITY)


def moe_flops(ins: Sequence[TensorMeta]) -> float:
    """Forward FLOPs of one ``moe_experts`` call from its operand metas: the routed (token, expert) pairs'
    three GEMMs (gate, up, down)."""
    index, gate = ins[1], ins[3]
    tokens, k = index.shape
    return 2.0 * tokens * k * 3 * gate.shape[1] * gate.shape[2]


#: compute-bound; backward: the input and the weight gradients, one forward's GEMMs each
@register_rule("autoshard::moe_experts", facts=OpFacts(flops=lambda call: moe_flops(call.inputs), backward_gemms=2))
def moe_experts_rule(call: OpCall) -> list[Strategy1D]:
    tokens = (S0, S0, S0)
    dispatch = EXPERT_DISPATCH_CAPACITY if (call.bound_args.get("capacity_factor") or 0) > 0 else EXPERT_DISPATCH
    return [
        Strategy1D(tokens + (R, R, R), (S0,)),
        Strategy1D((R, R, R, Shard(1), Shard(1), Shard(2)), (P,)),
        Strategy1D(tokens + (S0, S0, S0), (S0,), dispatch),
        Strategy1D((R, R, R, S0, S0, S0), (P,), dispatch),
    ]


def moe_role(strategy, axis: int) -> str:
    """What a ``moe_experts`` strategy does on mesh ``axis``: "expert parallel (all-to-all)", "expert
    parallel (local)", "data parallel", "tensor parallel" or "replicated" (for plan summaries)."""
    token, expert, out = strategy.inputs[0][axis], strategy.inputs[3][axis], strategy.outputs[0][axis]
    if isinstance(expert, Shard) and expert.dim == 0:
        return "expert parallel (all-to-all)" if isinstance(token, Shard) else "expert parallel (local)"
    if isinstance(expert, Shard):
        return "tensor parallel"
    if isinstance(token, Shard):
        return "data parallel"
    return "partial" if isinstance(out, Partial) else "replicated"
