"""Where a plan's estimated step goes, node by node: ``price_breakdown(plan)`` re-prices every op of every
stage with the plan's cost model (``CostModel.price_node`` under the chosen strategy) and sums the seconds
by kind (expert GEMMs, attention, other GEMMs, memory-bound ops by op, launch overhead, an op lowering's
own collectives such as MoE all-to-alls, parameters' gradient syncs and optimizer steps, redistributions).
Used by ``published_moe_layouts.py --breakdown``; figures are one rank's additive seconds per step (a
pipelined plan: one stage's per microbatch times its microbatches, summed over the stages one rank group
runs), before overlap, bubble and recompute (the solution's ``time_breakdown`` is printed next to them).
"""
from __future__ import annotations

from collections import defaultdict

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.model import CostModel
from autoshard.passes.cost.moe import is_moe_node
from autoshard.passes.op_facts import op_facts


def _kind(node, facts: GraphFacts) -> str:
    name = node.target.__name__ if hasattr(node.target, "__name__") else str(node.target)
    if is_moe_node(node):
        return "compute: expert GEMMs (moe_experts)"
    if op_facts(node.target).attention:
        return "compute: attention"
    if node.name in facts.gemm_dims or op_facts(node.target).flops is not None:
        return "compute: other GEMMs"
    return f"memory-bound: {name}"


def price_breakdown(plan, top: int = 14) -> list[str]:
    hw = get_hardware(plan.hardware)
    facts = GraphFacts(plan.captured, hw)
    groups = defaultdict(list)
    for st in plan.stages:
        groups[st.group].append(st)
    rank_group = max(groups, key=lambda g: sum(s.solution.estimated_step_time for s in groups[g]))
    m = plan.microbatches if plan.pipelined else max(1, plan.accumulation)
    sums: dict[str, float] = defaultdict(float)
    launches = 0.0
    lines = []
    for st in groups[rank_group]:
        sol = st.solution
        cm = CostModel(st.mesh, hw, "adamw")
        for name, strat in sol.strategies.items():
            kind = facts.kind.get(name)
            if kind is None:
                continue
            price = cm.price_node(name, strat, facts)
            node = facts.nodes[name]
            if kind == "param":
                sums["params: grad sync (unscaled, per microbatch)"] += sum(c.seconds for c in price.grad_sync)
                sums["params: optimizer step + accumulate"] += price.compute - facts.overhead(name)
                continue
            if kind != "op":
                continue
            over = facts.overhead(name)
            launches += over
            sums[_kind(node, facts)] += price.compute - over
            for c in price.collectives:
                sums[f"collective: {c.kind} (op lowering, axis {c.axis})"] += c.seconds
        for r in sol.redistributions:
            for c in r.collectives:
                sums[f"redistribution: {c.kind}"] += c.seconds
        lines.append(f"    stage {st.index} (group {st.group}): time_breakdown "
                     + ", ".join(f"{k} {v:.3f} s" for k, v in sol.time_breakdown.items())
                     + "; memory " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sol.memory_breakdown.items()))
    sums["launch overhead (all ops)"] = launches
    scale = m if plan.pipelined else 1
    head = (f"  breakdown of rank group {rank_group} ({len(groups[rank_group])} stage(s)), seconds per step "
            f"(x{scale} microbatches)" if plan.pipelined else
            f"  breakdown, seconds per captured program (accumulation {plan.accumulation})")
    out = [head]
    items = sorted(sums.items(), key=lambda kv: -kv[1])
    rest = sum(v for _, v in items[top:])
    for k, v in items[:top]:
        out.append(f"    {k:<58} {v * scale:9.3f}")
    out.append(f"    {'(other)':<58} {rest * scale:9.3f}")
    out.append(f"    {'sum':<58} {sum(sums.values()) * scale:9.3f}")
    return out + lines
