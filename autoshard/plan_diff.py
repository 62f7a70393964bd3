"""``plan_diff(a, b)``: what differs between two plans, as ``autoshard diff`` prints it.

Estimated step time and busiest-rank memory with their breakdowns, parameter placements (repeated
blocks folded as ``#`` with a count, as the summary folds them), the inserted collectives by phase and
kind with their bytes, and the gradient all-reduces. Plans need not share a mesh or hardware.
"""
from __future__ import annotations

import re
from collections import Counter

from autoshard.passes.spec import fmt_placements
from autoshard.passes.units import human_bytes, human_time

__all__ = ["plan_diff", "placement_changes", "collective_totals"]


def _fold(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


def placement_changes(a, b) -> dict[str, tuple]:
    """Parameter name -> (placements in a, in b) for every parameter placed differently (None: absent)."""
    pa, pb = a.param_placements, b.param_placements
    out = {}
    for name in list(pa) + [n for n in pb if n not in pa]:
        x, y = pa.get(name), pb.get(name)
        if x is None or y is None or tuple(x) != tuple(y):
            out[name] = (x, y)
    return out


def collective_totals(plan) -> dict[tuple[str, str], tuple[int, int]]:
    """(phase, kind) -> (calls, bytes) of the inserted collectives; ("grad", "all_reduce") for gradient syncs."""
    out: dict = {}
    for r in plan.solution.redistributions:
        for c in r.collectives:
            calls, nbytes = out.get((c.phase, c.kind), (0, 0))
            out[(c.phase, c.kind)] = (calls + 1, nbytes + c.bytes)
    for items in plan.solution.param_grad_syncs.values():
        for c in items:
            calls, nbytes = out.get(("grad", c.kind), (0, 0))
            out[("grad", c.kind)] = (calls + 1, nbytes + c.bytes)
    return out


def _delta(x: float, y: float, fmt) -> str:
    pct = f" ({(y - x) / x:+.1%})" if x else ""
    sign = "+" if y >= x else "-"
    return f"{fmt(x)} -> {fmt(y)}  {sign}{fmt(abs(y - x))}{pct}"


def plan_diff(a, b, name_a: str = "a", name_b: str = "b") -> str:
    """The differences between plans ``a`` and ``b`` as text (the module docstring lists what is compared)."""
    out = [f"autoshard diff {name_a} {name_b}"]
    if a.mesh.shape != b.mesh.shape or a.hardware != b.hardware:
        out.append(f"  mesh {a.mesh.shape} on {a.hardware} -> {b.mesh.shape} on {b.hardware}")
    out.append(f"  estimated step time: {_delta(a.estimated_step_time, b.estimated_step_time, human_time)}")
    ta, tb = a.solution.time_breakdown, b.solution.time_breakdown
    for k in dict.fromkeys(list(ta) + list(tb)):
        if ta.get(k, 0.0) != tb.get(k, 0.0):
            out.append(f"    {k}: {_delta(ta.get(k, 0.0), tb.get(k, 0.0), human_time)}")
    out.append(f"  estimated memory, busiest device: {_delta(a.estimated_memory, b.estimated_memory, human_bytes)}")
    ma, mb = a.solution.memory_breakdown, b.solution.memory_breakdown
    for k in dict.fromkeys(list(ma) + list(mb)):
        if ma.get(k, 0.0) != mb.get(k, 0.0):
            out.append(f"    {k}: {_delta(ma.get(k, 0.0), mb.get(k, 0.0), human_bytes)}")
    changes = placement_changes(a, b)
    folded: Counter = Counter()
    for name, (x, y) in changes.items():
        folded[(_fold(name), "absent" if x is None else fmt_placements(x), "absent" if y is None else fmt_placements(y))] += 1
    out.append(f"  parameters placed differently: {len(changes)} of {len(set(a.param_placements) | set(b.param_placements))}")
    width = max((len(k[0]) for k in folded), default=0)
    for (name, x, y), count in folded.items():
        out.append(f"    {name:<{width}}  {x} -> {y}" + (f"  x{count}" if count > 1 else ""))
    ca, cb = collective_totals(a), collective_totals(b)
    moved = [k for k in dict.fromkeys(list(ca) + list(cb)) if ca.get(k, (0, 0)) != cb.get(k, (0, 0))]
    out.append("  collectives (calls, bytes)" + ("" if moved else ": the same"))
    for phase, kind in moved:
        (n1, b1), (n2, b2) = ca.get((phase, kind), (0, 0)), cb.get((phase, kind), (0, 0))
        label = "gradient" if phase == "grad" else phase
        out.append(f"    {label} {kind}: {n1} calls {human_bytes(b1)} -> {n2} calls {human_bytes(b2)}")
    if not changes and not moved and a.estimated_step_time == b.estimated_step_time:
        out.append("  the plans place everything alike")
    return "\n".join(out)
