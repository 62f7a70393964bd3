"""autoshard's plan next to a hand-written layout's, priced by the same cost model (``autoshard plan
SPEC --compare LAYOUT``; ``benchmarks/published_layouts.py``).

>>> print(compare_table([("autoshard", Row(2.0, 40e9, 0.5, 0.1, 1.9)), ("megatron:tp=8", Row(2.5, 30e9, 0.4, 0.3, 2.4))]))
plan           step (additive)  step (overlap)  memory     MFU    exposed comm  ratio (additive / overlap)
autoshard      2.00 s           1.90 s          37.25 GiB  50.0%  100.00 ms     0.800 / 0.792
megatron:tp=8  2.50 s           2.40 s          27.94 GiB  40.0%  300.00 ms     1.000 / 1.000

``ratio``: each plan's step over the LAST row's (the layout's), additive and with overlap; "-" where
either plan has no overlap estimate (pipelined plans: their simulated step is the only one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autoshard.passes.units import human_bytes, human_time

__all__ = ["Row", "row_of", "compare_table"]


@dataclass(frozen=True)
class Row:
    """One plan's figures: additive step (s), memory (bytes), MFU (0..1 or None), exposed communication
    (s or None), step with overlap (s or None)."""
    step: float
    memory: float
    mfu: Optional[float]
    exposed: Optional[float]
    overlapped: Optional[float]


def row_of(plan) -> Row:
    """A ``Plan``'s figures. Exposed communication: the overlap model's when the plan
    has it, else every communication second (additive: nothing hides)."""
    sol = getattr(plan, "solution", None)
    est = dict(getattr(sol, "estimated", {}) or {}) if sol is not None else {}
    tb = dict(getattr(sol, "time_breakdown", {}) or {}) if sol is not None else {}
    exposed = est.get("exposed_communication_s")
    if exposed is None and tb:
        exposed = sum(v for k, v in tb.items() if k != "compute" and k != "recompute")
    return Row(float(plan.estimated_step_time), float(plan.estimated_memory), plan.mfu, exposed,
               est.get("overlapped_step_s"))


def compare_table(rows: list[tuple[str, Row]]) -> str:
    """Rows side by side; ratios against the last row."""
    base = rows[-1][1]
    table = [("plan", "step (additive)", "step (overlap)", "memory", "MFU", "exposed comm", "ratio (additive / overlap)")]
    for label, r in rows:
        over = f"{r.overlapped / base.overlapped:.3f}" if r.overlapped and base.overlapped else "-"
        table.append((label, human_time(r.step), human_time(r.overlapped) if r.overlapped else "-", human_bytes(r.memory),
                      f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-",
                      human_time(r.exposed) if r.exposed is not None else "-", f"{r.step / base.step:.3f} / {over}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
