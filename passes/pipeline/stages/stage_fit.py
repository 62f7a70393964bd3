"""A candidate's intra-op plan that its stages can hold.

The stage planner picks each (pp, submesh) candidate's intra-op plan (``candidate_plan.plan_submesh``)
under a proxy budget: pp x the memory limit for the whole program, activations counted for a 1F1B
stage's average in-flight count. It then cuts stages under the exact per-group constraint
(``stage_ilp`` (3')): the whole-step stage peak with the accumulated gradients, the p2p buffers, the
optimizer step's temporaries and each group's own in-flight count. The proxy is the looser of the
two, so a larger memory limit can let the intra-op ILP keep weights replicated that no stage cut
then holds: more memory made the plan infeasible (a GPT with pp = 2 planned at 330 KB and 360 KB,
not at 400 KB).

``fitting_profile`` closes the loop: when no balanced cut of any searched (schedule, m) fits the
limit (``search.fit_check``), the candidate is planned again under a budget shrunk by how far its leanest
cut overshoots (and by at least ``SHRINK``), ``REPLANS`` times, then as the least-memory plan. The
first profile some cut fits is kept; if none fits, the leanest (the stage ILP may still find an
unbalanced cut, and the infeasible message names what it needs). A candidate that fits at once is
planned exactly as before. Everything here is deterministic: budgets come from bytes, not clocks.
"""
from __future__ import annotations

import math
from typing import Callable

from autoshard.passes.pipeline.stages.layer_costs import SubmeshProfile
from autoshard.passes.solve.solution import Solution

__all__ = ["fitting_profile", "REPLANS", "SHRINK"]

#: re-plans under a shrunk budget before the least-memory plan
REPLANS = 2
#: each re-plan's budget is at most this fraction of the previous one (progress even when the
#: leanest cut overshoots the limit by a hair)
SHRINK = 0.9


def fitting_profile(plan: Callable[[float], tuple[Solution, SubmeshProfile]], budget: float,
                    check: Callable[[SubmeshProfile], tuple[float, float]], memory_limit: float
                    ) -> tuple[Solution, SubmeshProfile, list[dict]]:
    """The intra-op plan and profile of one candidate (module docstring): ``plan(budget)`` plans it
    under a whole-program budget (0: nothing fits, so the least-memory plan), ``check`` is
    ``search.fit_check`` bound to the candidate. Also one row per re-plan (budget, status, need)."""
    sol, prof = plan(budget)
    step, need = check(prof)
    tries: list[dict] = []
    leanest = (need, sol, prof)
    while step == math.inf and budget > 0 and sol.solver_stats.get("status") != "MEMORY_FALLBACK":
        if len(tries) < REPLANS and math.isfinite(need) and need > 0:
            budget *= min(SHRINK, memory_limit / need)
        else:
            budget = 0.0
        sol, prof = plan(budget)
        step, need = check(prof)
        tries.append({"budget": round(budget), "status": sol.solver_stats.get("status"),
                      "need": None if math.isinf(need) else round(need), "fits": step < math.inf})
        if need < leanest[0]:
            leanest = (need, sol, prof)
    if step == math.inf:
        _, sol, prof = leanest
    return sol, prof, tries
