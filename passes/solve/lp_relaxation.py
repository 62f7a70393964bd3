"""GLOP's LP relaxation of the sharding ILP (``LPRelaxation``, a base of ``ilp_model.ShardingILP``): the
bound and warm start of ``ilp.solve``, and the LPs of the memory search and the peak retries, solved again
on one kept GLOP solver from its last optimal basis.

``LPRelaxation`` reads the model's state that ``ShardingILP.__init__`` sets: ``x`` (variables per node),
``rows``, ``objective``, ``num_vars``, ``memory_row``, ``solved_again`` and the kept solver's ``_lp``,
``_lp_costs``, ``_lp_vars``, ``_lp_rows``, ``lp_iterations``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ortools.linear_solver import linear_solver_pb2, pywraplp

__all__ = ["LPRelaxation", "unit_variables"]

#: GLOP's parameters for an LP solved again on a kept solver: presolve would rebuild a reduced problem
#: (and lose the basis) whenever a bound changes; dual simplex restarts from the last optimal basis, which
#: stays dual feasible when a row's bound moves
_WARM = "use_preprocessing:false use_dual_simplex:true"

#: GLOP's parameters for the first LP of an ILP with a memory row (the one a peak retry lowers): without
#: presolve the solver's basis is one of the whole LP, from which the next solve (a Lagrangian price, a
#: lowered bound) restarts; after a presolved solve it held the reduced problem's, and that next solve
#: started cold (a tiny Llama: 0.17-0.25 CPU s each, against 0.02-0.05 from the kept basis). Primal
#: simplex, GLOP's default: the plans of ``benchmarks/memory_limit_plan_time.py`` keep their estimates
#: (dual simplex from the start reached another LP optimum, and the tiny Llama's peak retries a 0.26 %
#: slower plan)
_COLD_KEPT = "use_preprocessing:false"

#: ``pywraplp.Objective.SetCoefficient`` is this call behind a Python method: a Lagrangian price sets and
#: restores 14 K coefficients on a tiny Llama
_set_coefficient = pywraplp._pywraplp.Objective_SetCoefficient
#: ``pywraplp.Constraint.SetCoefficient``'s own call (``adopt_lp`` sets the changed terms of the rows)
_set_row_coefficient = pywraplp._pywraplp.Constraint_SetCoefficient


def unit_variables(costs: list[float]) -> bytes:
    """An ``MPModelProto``'s wire bytes holding one variable per cost: bounds 0 and 1, that objective
    coefficient, each field present (what ``variable.add()`` and setting the three fields makes), laid
    out by numpy: a Python call per field was a third of building a tiny Llama's LP (34 K variables)."""
    n = len(costs)
    wire = np.empty((n, 29), dtype=np.uint8)
    wire[:, 0], wire[:, 1] = 3 << 3 | 2, 27  # MPModelProto.variable (3), length-delimited: 3 doubles and tags
    for at, number, values in ((2, 1, np.zeros(n)), (11, 2, np.ones(n)), (20, 3, np.asarray(costs, dtype=float))):
        wire[:, at] = number << 3 | 1  # lower_bound (1), upper_bound (2), objective_coefficient (3): 64-bit
        wire[:, at + 1:at + 9] = values.astype("<f8").view(np.uint8).reshape(n, 8)
    return wire.tobytes()


class LPRelaxation:
    """The LP half of ``ShardingILP`` (module docstring)."""

    def lp_relaxation(self) -> tuple[str, Optional[list[int]], Optional[float], bool]:
        """GLOP on the relaxation (0 <= x, e <= 1): (status, rounded choice, objective lower bound in
        objective units, whether the LP optimum is integral). Status "INFEASIBLE" proves the ILP
        infeasible too; "UNKNOWN" when GLOP is unavailable or fails. The optimum's reduced costs and
        row duals are kept (``lp_reduced_costs``, ``lp_duals``) for ``passes.solve.memory_search``."""
        status, response = self.solve_lp()
        if status != "OPTIMAL":
            return status, None, None, False
        values = list(response.variable_value)
        self.lp_reduced_costs, self.lp_duals = list(response.reduced_cost), list(response.dual_value)
        integral = all(min(values[k], 1 - values[k]) < 1e-6 for xs in self.x for k in xs)
        if self.memory_row is not None:
            _, ids, coefs, _, hi = self.rows[self.memory_row]
            self.memory_binding = sum(values[k] * c for k, c in zip(ids, coefs)) > hi * (1 - 1e-6)
        return "OPTIMAL", self.choice_from(lambda k: values[k]), response.objective_value, integral

    def solve_lp(self, extra_costs: Optional[dict[int, float]] = None, skip_row: Optional[int] = None
                 ) -> tuple[str, Optional["linear_solver_pb2.MPSolutionResponse"]]:
        """GLOP on the relaxation, the objective plus ``extra_costs`` (variable -> coefficient), row
        ``skip_row`` left out: (status, response); status "OPTIMAL", "INFEASIBLE" or "UNKNOWN".

        The first call loads the model into a GLOP solver that this ILP keeps; later calls (another
        objective, a row left out, the memory bound lowered by ``set_memory_limit``) change only those
        coefficients and bounds and solve again without presolve, by dual simplex from the last optimal
        basis (``_WARM``): a tiny Llama's LP under a binding memory row, 0.2-0.3 CPU s cold, then takes
        0.02-0.05 s once warm. The first solve of an ILP kept for peak retries (``solved_again``) whose
        memory row can bind runs without presolve (``_COLD_KEPT``), so its basis is the whole LP's and the
        next solve starts from it; any other keeps GLOP's defaults (the pipeline candidates' ILPs, solved
        once: presolved, their LP optimum and so their plans those of before)."""
        lp = self._lp
        if lp is None:
            lp = pywraplp.Solver.CreateSolver("GLOP")
            if lp is None:
                return "UNKNOWN", None
            # built as one proto (repeated fields filled in bulk), not a Python call per variable and per
            # coefficient: on GPT-3 175B's pipeline plan those calls were 4.8 s against GLOP's 6.3 s
            model = linear_solver_pb2.MPModelProto()
            costs = [0.0] * self.num_vars
            for k, c in zip(*self.objective):
                costs[k] += c
            for k, c in (extra_costs or {}).items():
                costs[k] += c
            model.MergeFromString(unit_variables(costs))
            for index, (_, ids, coefs, lo, hi) in enumerate(self.rows):
                if index == skip_row:
                    continue
                row = model.constraint.add()
                row.var_index.extend(ids)
                row.coefficient.extend(coefs)
                row.lower_bound = lo
                row.upper_bound = hi
            if lp.LoadModelFromProto(model):
                return "UNKNOWN", None
            if extra_costs or skip_row is not None:  # a changed model: not kept
                return self._lp_answer(lp, lp.Solve())
            self._lp, self._lp_costs = lp, costs
            if self.solved_again and self._memory_row_can_bind():  # a lowered bound next: from this basis
                lp.SetSolverSpecificParametersAsString(_COLD_KEPT)
            return self._kept_answer(lp)
        lp.SetSolverSpecificParametersAsString(_WARM)
        if not self._lp_rows:
            self._lp_rows = lp.constraints()
        variables, objective = self._lp_vars, lp.Objective()
        costs = self._lp_costs
        for k in (extra_costs or {}):  # handles of the variables priced, made once each
            if k not in variables:
                variables[k] = lp.variable(k)
        for k, c in (extra_costs or {}).items():  # (``Objective.SetCoefficient``'s own call, without its wrapper)
            _set_coefficient(objective, variables[k], costs[k] + c)
        constraints = self._lp_rows
        if self.memory_row is not None:
            _, _, _, lo, hi = self.rows[self.memory_row]
            constraints[self.memory_row].SetBounds(lo, hi)
        if skip_row is not None:
            constraints[skip_row].SetBounds(-lp.infinity(), lp.infinity())
        answer = self._kept_answer(lp)
        for k in (extra_costs or {}):
            _set_coefficient(objective, variables[k], costs[k])
        if skip_row is not None:
            _, _, _, lo, hi = self.rows[skip_row]
            constraints[skip_row].SetBounds(lo, hi)
        if answer[1] is not None and skip_row is not None:  # the rows as a fresh solve numbers its duals
            del answer[1].dual_value[skip_row]
        return answer

    def adopt_lp(self, donor: "LPRelaxation") -> bool:
        """Take over ``donor``'s kept GLOP solver for this ILP's LPs, when both are kept for peak retries
        (``solved_again``), this one has solved no LP, its memory row can bind, and the two ILPs have as
        many variables and rows, the memory row at the same place (the ILPs of two policy combinations of
        one lever graph, or of two layouts' slices of it: ``policy_solves.solve_policies``). The solver's
        objective, and the terms and bounds of every row that differs (the memory row's bytes, a few edges'
        class indicators), are set to this ILP's: the LP is then this ILP's whatever ``donor`` was, and its
        first solve restarts from ``donor``'s last optimal basis (``_WARM``) at the optimum a fresh solver
        would reach (a tiny Llama's policies: 100-500 simplex iterations, 0.04-0.07 CPU s, instead of
        2,000-2,700 cold, 0.25-0.35). ``donor`` keeps no solver (its next LP would start cold). False,
        nothing changed, otherwise."""
        lp, m = donor._lp, self.memory_row
        if lp is None or self._lp is not None or not (self.solved_again and donor.solved_again):
            return False
        if m is None or m != donor.memory_row or self.num_vars != donor.num_vars or len(self.rows) != len(donor.rows):
            return False
        if not self._memory_row_can_bind():
            return False
        changed = [i for i, (row, old) in enumerate(zip(self.rows, donor.rows)) if row != old]
        if any(self.rows[i][0] != donor.rows[i][0] for i in changed):
            return False
        costs = np.zeros(self.num_vars)
        np.add.at(costs, np.asarray(self.objective[0], dtype=np.int64), np.asarray(self.objective[1], dtype=float))
        handles = lp.variables()
        objective = lp.Objective()
        for k in np.flatnonzero(costs != np.asarray(donor._lp_costs)).tolist():
            _set_coefficient(objective, handles[k], costs[k])
        constraints = donor._lp_rows or lp.constraints()
        for i in changed:
            _, ids, coefs, lo, hi = self.rows[i]
            _, old_ids, old_coefs, _, _ = donor.rows[i]
            terms, old_terms = dict(zip(ids, coefs)), dict(zip(old_ids, old_coefs))
            for k in sorted(terms.keys() | old_terms.keys()):
                if terms.get(k, 0) != old_terms.get(k, 0):
                    _set_row_coefficient(constraints[i], handles[k], terms.get(k, 0))
            constraints[i].SetBounds(lo, hi)
        self._lp, self._lp_costs, self._lp_vars, self._lp_rows = lp, costs.tolist(), donor._lp_vars, constraints
        donor._lp, donor._lp_vars, donor._lp_rows = None, {}, []
        self.lp_adopted = True
        return True

    def _memory_row_can_bind(self) -> bool:
        """Whether the memory row's bytes, every term at once, exceed its bound: a limit above them (the
        hardware's memory on a small model) never binds, and its ILP is solved as one without the row
        (presolved: the same LP optimum, so the same answer among plans of equal cost)."""
        if self.memory_row is None:
            return False
        _, _, coefs, _, hi = self.rows[self.memory_row]
        return sum(c for c in coefs if c > 0) > hi

    def _kept_answer(self, lp) -> tuple[str, Optional["linear_solver_pb2.MPSolutionResponse"]]:
        """``_lp_answer`` of the kept solver ``lp`` solved now, its simplex iterations counted."""
        status = lp.Solve()
        self.lp_iterations.append(lp.iterations())
        return self._lp_answer(lp, status)

    @staticmethod
    def _lp_answer(lp, status) -> tuple[str, Optional["linear_solver_pb2.MPSolutionResponse"]]:
        if status == pywraplp.Solver.INFEASIBLE:
            return "INFEASIBLE", None
        if status != pywraplp.Solver.OPTIMAL:
            return "UNKNOWN", None
        response = linear_solver_pb2.MPSolutionResponse()
        lp.FillSolutionResponseProto(response)
        return "OPTIMAL", response
