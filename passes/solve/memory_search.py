"""Solving the sharding ILP when its memory row binds: a Lagrangian warm start, reduced-cost fixing,
and one sequential search.

Without a memory limit the ILP's LP relaxation is integral on the planner's graphs and CP-SAT only
confirms it. A binding memory row (one knapsack constraint over every strategy and edge pair) makes
the LP optimum fractional; on small models many strategies then cost nearly the same, and CP-SAT's
interleaved portfolio spent its whole work budget without closing the gap (a 22 K-parameter Llama on
(2, 2): 30 deterministic seconds, 6.7 % from its bound; issue 31, item 10). Three exact moves:

1. **Lagrangian warm start** (``lagrangian_hint``). The memory row's LP dual ``lambda`` prices a byte in
   seconds; the relaxation without that row and with every variable's bytes priced at
   ``lambda (1 + eps)`` has an integral optimum on these graphs, which lies on the memory-feasible side
   of the LP optimum: a plan that fits, usually a few per cent from the bound (Fisher, "The Lagrangian
   relaxation method for solving integer programming problems", Management Science 1981). It replaces
   the greedy hint when it fits and is cheaper.
2. **Reduced-cost fixing** (``reduced_cost_fixings``). At the LP optimum of value ``LB`` with reduced
   costs ``d``, every feasible point with ``x_j = 1`` costs at least ``LB + d_j`` (the memory row's
   dual only adds). A variable with ``LB + d_j`` above the warm start's objective ``UB`` is 0 in every
   plan at least as good as the warm start, so it becomes the constant 0: the optimum is unchanged,
   and on that Llama 22 K of 34 K variables go. When the planner already holds a plan (its
   ``cutoff``), ``UB`` is the smaller of that plan's step and the warm start's, and the objective is
   bounded by the cutoff too: a solve then answers only with a plan that beats it, or "CUTOFF". The
   warm start is priced under a cutoff as well: the cutoff comes from another policy or microstep
   count and can lie far above this problem's optimum, where the Lagrangian plan often is.
3. **One sequential search**: CP-SAT's portfolio runs six full-problem subsolvers, each paying its own
   root propagation and probing before searching; one LP-guided search proves the same optimum in a
   quarter of the work there (``ShardingILP.solve_cpsat(portfolio=False)``).

Each move keeps the optimum, so with the work it needs the answer is the ILP's optimum; a solve that
used to stop short of it at its work limit now reaches it (a faster plan than before) or stops nearer.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

__all__ = ["lagrangian_hint", "reduced_cost_fixings", "hint_objective", "cutoff_units", "LAGRANGE_SLACK"]

#: how far above the memory row's dual the Lagrangian prices a byte: enough to break the tie between
#: the LP optimum's two sides towards the one that fits, small next to the dual itself
LAGRANGE_SLACK = 1e-3


def lagrangian_hint(ilp, fits: Callable[[list[int]], bool]) -> Optional[list[int]]:
    """A full choice from the relaxation priced at the memory row's dual (module docstring, move 1),
    when ``fits`` it; None without a binding memory row or LP duals (``ilp.lp_relaxation`` first)."""
    row = ilp.memory_row
    duals = getattr(ilp, "lp_duals", None)
    if row is None or not duals:
        return None
    price = -duals[row]  # GLOP: a <= row of a minimisation has a non-positive dual
    if price <= 0:
        return None
    _, ids, coefs, _, _ = ilp.rows[row]
    per_unit = price * (1 + LAGRANGE_SLACK)
    extra = dict(zip(ids, [per_unit * c for c in coefs]))  # the row lists each variable once (``_memory_terms``)
    if len(extra) < len(ids):  # (a row that repeats one: its terms summed)
        extra = {}
        for k, c in zip(ids, coefs):
            extra[k] = extra.get(k, 0.0) + per_unit * c
    status, response = ilp.solve_lp(extra, skip_row=row)
    if status != "OPTIMAL":
        return None
    values = response.variable_value
    choice = ilp.choice_from(lambda k: values[k])
    return choice if fits(choice) else None


def hint_objective(ilp, hint: list[int]) -> int:
    """``hint``'s objective in the ILP's integer units (what CP-SAT reports for it)."""
    on = ilp.hint_literals(hint)
    return sum(c for k, c in zip(*ilp.objective) if k in on)


def cutoff_units(ilp, cutoff: float) -> int:
    """``cutoff`` seconds in the ILP's integer objective units, rounded up by what rounding each
    coefficient can add (half a unit per term of one plan: one per node and per edge), so no plan
    faster than ``cutoff`` is above it."""
    return math.ceil(cutoff * ilp.scale + 0.5 * (len(ilp.x) + len(ilp.edge_terms)) + 1)


def reduced_cost_fixings(ilp, lower_bound: float, hint: Optional[list[int]],
                         cutoff: Optional[int] = None) -> frozenset:
    """Variables 0 in every choice at least as good as ``hint`` and below ``cutoff`` (integer objective
    units, ``cutoff_units``: the planner wants nothing slower than the best plan it already has), from
    the LP optimum ``lower_bound`` and its reduced costs (module docstring, move 2; ``ilp.lp_relaxation``
    first). The margin covers GLOP's float tolerance; a hint within the cutoff keeps its variables."""
    costs = getattr(ilp, "lp_reduced_costs", None)
    bounds = [b for b in (None if hint is None else hint_objective(ilp, hint), cutoff) if b is not None]
    if not costs or not bounds:
        return frozenset()
    upper = min(bounds)
    margin = 1e-6 * max(abs(upper), 1.0) + 1.0
    keep = ilp.hint_literals(hint) if hint is not None and hint_objective(ilp, hint) <= upper else set()
    # compared in bulk (the same float sums as one at a time): 34 K reduced costs a tiny Llama's solve
    over = np.flatnonzero(lower_bound + np.asarray(costs, dtype=float) > upper + margin).tolist()
    return frozenset(k for k in over if k not in keep)
