"""Where a plan's estimated step goes, node by node: ``price_breakdown(plan)`` re-prices every op of every
stage with the plan's cost model (``CostModel.price_node`` under the chosen strategy) and sums the seconds
by kind (expert GEMMs, attention, other GEMMs, memory-bound ops by op, launch overhead, an op lowering's
own collectives such as MoE all-to-alls, parameters' gradient syncs and optimizer steps, redistributions).
Used by ``published_moe_layouts.py --breakdown``; figures are one rank's additive seconds per step, before
overlap, bubble and recompute (each stage's ``time_breakdown`` is printed next to them). Without a pipeline
the captured program is one accumulation microstep, so its prices are multiplied by the accumulation; a
pipelined plan's captured program is the whole batch (each stage's work divided over its data-parallel
ranks), so the prices of the stages one rank group runs are summed as they are.
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
    sums: dict[str, float] = defaultdict(float)
    once: dict[str, float] = defaultdict(float)  # per step, whatever the accumulation
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
                once["params: gradient all-reduces (once per step)"] += sum(c.seconds for c in price.grad_sync)
                once["params: optimizer step (once per step)"] += price.compute - facts.overhead(name)
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
    scale = 1 if plan.pipelined else max(1, plan.accumulation)
    head = (f"  breakdown of rank group {rank_group} ({len(groups[rank_group])} stage(s)), seconds per step, "
            f"recompute and bubble not included" if plan.pipelined else
            f"  breakdown, seconds per step (captured microstep x accumulation {scale}), recompute not included")
    out = [head]
    scaled = {k: v * scale for k, v in sums.items()}
    scaled.update(once)
    items = sorted(scaled.items(), key=lambda kv: -kv[1])
    rest = sum(v for _, v in items[top:])
    for k, v in items[:top]:
        out.append(f"    {k:<58} {v:9.3f}")
    out.append(f"    {'(other)':<58} {rest:9.3f}")
    out.append(f"    {'sum':<58} {sum(scaled.values()):9.3f}")
    return out + lines
