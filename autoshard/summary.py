"""Text summary of a plan: estimates, parameter placements (repeated blocks folded), collectives."""
from __future__ import annotations

import re
from collections import Counter

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
    levers = getattr(sol, "levers", None)
    if levers is not None and levers.any_pulled:
        blocks = "; ".join(f"{t}: checkpoint {p.checkpoint}, reshard after forward {p.reshard_after_forward}"
                           for t, p in sorted(levers.blocks.items()))
        mp = levers.mixed_precision
        out.append(f"  memory levers: accumulation {levers.accumulation}"
                   + (f"; {blocks}" if blocks else "")
                   + (f"; compute in {mp.param_dtype_name}, reduce gradients in "
                      f"{mp.reduce_dtype_name or mp.param_dtype_name}" if mp is not None else ""))
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
    if sol.unruled_ops:
        out.append(f"  ops run replicated for lack of a sharding rule: {', '.join(sol.unruled_ops)}")
    stats = getattr(sol, "solver_stats", {}) or {}
    if stats:
        out.append("  solver: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    return "\n".join(out)
