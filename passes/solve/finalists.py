"""Pick the plan among the lever search's finalists by the overlap model's step, not the ILP's sum.

The ILP minimises the additive step (compute + communication + gradient sync + recomputation): a
linear objective it can prove optimal. A GPU runs collectives on their own stream, so a plan whose
communication is FSDP gathers and bucketed gradient reductions (hidden behind compute) can beat a
plan whose smaller communication is exposed tensor-parallel all-reduces (``passes/cost/overlap.py``).
The lever search (``planner._plan_within``) keeps every plan that fit the memory limit and improved
its additive best (one per microstep count and block-policy combination that won at its time); each
is already evaluated, overlap included, so re-scoring them costs nothing. ``pick_finalist`` returns
the one with the smallest overlapped step (ties: the earlier, i.e. the additive order), and a record
of the choice for ``solver_stats["finalists"]``, which ``plan.summary()`` prints.

>>> pick_finalist(["a", "b"], {"a": _S(10.0, 6.0), "b": _S(9.0, 8.5)}.get)[0]
'a'
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

__all__ = ["overlapped_step", "pick_finalist"]

T = TypeVar("T")


def overlapped_step(solution) -> float:
    """The overlap model's step of an evaluated solution (its additive step when it has none)."""
    est = getattr(solution, "estimated", None) or {}
    return float(est.get("overlapped_step_s", solution.estimated_step_time))


def pick_finalist(finalists: Sequence[T], solution_of: Callable[[T], object],
                  additive_index: Optional[int] = None) -> tuple[T, dict]:
    """(the finalist with the smallest overlapped step, a JSON record of the re-scoring). ``finalists``
    in the order the search found them; ``additive_index`` (default: the last) is the additive choice,
    those after it the published layouts' plans (``layout_finalists``). Ties: the search's plans before the
    layouts', the later (additively better) of the search's first."""
    if not finalists:
        raise ValueError("pick_finalist needs at least one finalist")
    additive_i = len(finalists) - 1 if additive_index is None else additive_index
    scored = [(overlapped_step(solution_of(f)), i > additive_i, -i) for i, f in enumerate(finalists)]
    best_step, _, best_i = min(scored)
    best_i = -best_i
    record = {"count": len(finalists), "rescored_by": "overlap",
              "additive_choice_overlapped_s": scored[additive_i][0], "chosen_overlapped_s": best_step,
              "chosen_additive_s": float(solution_of(finalists[best_i]).estimated_step_time),
              "changed": best_i != additive_i}
    if additive_i < len(finalists) - 1:
        record.update(layouts=len(finalists) - 1 - additive_i, layout_chosen=best_i > additive_i)
    return finalists[best_i], record


class _S:  # a stand-in solution for the doctest
    def __init__(self, additive: float, overlapped: float):
        self.estimated_step_time, self.estimated = additive, {"overlapped_step_s": overlapped}
