"""Text summary of a plan: estimates, parameter placements (repeated blocks folded), collectives, and the
ops that run replicated for lack of a sharding rule with what that costs."""
from __future__ import annotations

import re
from collections import Counter

from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import AutoshardError
from autoshard.passes.solve.replicated_ops import REGISTER_HINT, replicated_op_costs
from autoshard.passes.spec import fmt_placements
from autoshard.passes.units import human_bytes, human_time


def _fold(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


def plan_summary(plan) -> str:
    sol, mesh = plan.solution, plan.mesh
    out = [f"autoshard plan: mesh {mesh.shape} axes {mesh.axis_names}, hardware {plan.hardware}"]
    tb = getattr(sol, "time_breakdown", {}) or {}
    out.append(f"  estimated step time: {human_time(plan.estimated_step_time)}  ("
               + ", ".join(f"{k} {human_time(v)}" for k, v in tb.items()) + ")")
    mb = getattr(sol, "memory_breakdown", {}) or {}
    out.append(f"  estimated memory, busiest device: {human_bytes(plan.estimated_memory)}  ("
               + ", ".join(f"{k} {human_bytes(v)}" for k, v in mb.items()) + ")")
    out.append("  parameters (storage placement per mesh axis; repeated blocks folded as #):")
    folded: dict[str, tuple[str, int]] = {}
    for name, pls in plan.param_placements.items():
        key = (_fold(name), fmt_placements(pls))
        folded[key] = folded.get(key, 0) + 1
    width = max((len(k[0]) for k in folded), default=10)
    for (name, pls), count in folded.items():
        out.append(f"    {name:<{width}}  {pls}" + (f"  x{count}" if count > 1 else ""))
    kinds = {"fwd": Counter(), "bwd": Counter()}
    total_bytes = 0
    for r in sol.redistributions:
        for c in r.collectives:
            kinds.setdefault(c.phase, Counter())[c.kind] += 1
            total_bytes += c.bytes
    syncs = Counter(c.kind for items in sol.param_grad_syncs.values() for c in items)
    out.append(f"  inserted collectives: forward {sum(kinds['fwd'].values())} {dict(kinds['fwd'])}, "
               f"backward {sum(kinds['bwd'].values())} {dict(kinds['bwd'])}, {human_bytes(total_bytes)} in all")
    out.append(f"  gradient syncs: {sum(syncs.values())} {dict(syncs)}")
    out += _replicated_lines(plan)
    stats = getattr(sol, "solver_stats", {}) or {}
    if stats:
        out.append("  solver: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    return "\n".join(out)


def _replicated_lines(plan) -> list[str]:
    """The ops without a rule: per op, its outputs on every device and its seconds per step (needs the
    captured graph and a known hardware; a loaded plan lists the names only), and the remedy."""
    names = list(plan.solution.unruled_ops)
    if not names:
        return []
    costs = None
    if plan.captured is not None:
        try:
            costs = replicated_op_costs(plan.captured, plan.mesh, get_hardware(plan.hardware))
        except (AutoshardError, OSError, ValueError):  # a hardware label naming no preset or profile here
            costs = None
    out = ["  ops run replicated for lack of a sharding rule (whole outputs on every device):"]
    if costs:
        for c in costs:
            out.append(f"    {c.op} x{c.nodes}: outputs {human_bytes(c.output_bytes)} per device "
                       f"({human_bytes(c.split_bytes(plan.mesh))} if split over {plan.mesh.size}), "
                       f"{human_time(c.seconds)} per step")
    else:
        out.append(f"    {', '.join(names)}")
    out.append(f"    to let them shard, {REGISTER_HINT}")
    return out
