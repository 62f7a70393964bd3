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


def breakdown_parts(plan) -> tuple[dict[str, float], list[str]]:
    """Seconds per step by kind for the busiest rank group (module docstring), and one line per stage
    with its solution's own time and memory breakdowns."""
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
            if kind not in ("param", "op"):
                continue
            price = cm.price_node(name, strat, facts)
            if kind == "param":
                once["params: gradient all-reduces (once per step)"] += sum(c.seconds for c in price.grad_sync)
                once["params: optimizer step (once per step)"] += price.compute - facts.overhead(name)
                continue
            over = facts.overhead(name)
            launches += over
            sums[_kind(facts.nodes[name], facts)] += price.compute - over
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
    parts = {k: v * scale for k, v in sums.items()}
    parts.update(once)
    return parts, lines


def price_breakdown(plan, top: int = 14) -> list[str]:
    """``breakdown_parts`` as report lines: the ``top`` largest kinds, the rest, the sum, the stages."""
    parts, lines = breakdown_parts(plan)
    head = (f"  breakdown of the busiest rank group, seconds per step, recompute and bubble not included"
            if plan.pipelined else
            f"  breakdown, seconds per step (captured microstep x accumulation {max(1, plan.accumulation)}), "
            "recompute not included")
    items = sorted(parts.items(), key=lambda kv: -kv[1])
    out = [head] + [f"    {k:<58} {v:9.4f}" for k, v in items[:top]]
    out.append(f"    {'(other)':<58} {sum(v for _, v in items[top:]):9.4f}")
    out.append(f"    {'sum':<58} {sum(parts.values()):9.4f}")
    return out + lines
