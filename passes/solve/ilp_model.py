"""The sharding ILP's model (``ShardingILP``): its variables and rows, and CP-SAT; GLOP's LP relaxation is
``passes/solve/lp_relaxation.py``'s ``LPRelaxation``, which it inherits.

The formulation is ``passes/solve/ilp.py``'s docstring; ``ilp.solve`` drives it (bounds, warm starts,
the memory search). One ``ShardingILP`` can be solved again after its memory row's bound is lowered
(``set_memory_limit``): its LP solver is kept, so later LPs start from the last optimal basis.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ortools.sat.python import cp_model

from autoshard.passes.solve.cpsat_model import RowTerms, cpsat_model
from autoshard.passes.solve.lp_relaxation import LPRelaxation, unit_variables
from autoshard.passes.solve.strategy_graph import SGEdge, StrategyGraph

__all__ = ["ILPResult", "ShardingILP", "CPSAT_SEED", "unit_variables"]

_SCALE_TARGET = 1e9

CPSAT_SEED = 0  # fixed: the same inputs give the same plan


@dataclass
class ILPResult:
    choice: Optional[list[int]]
    cost: float
    memory: float
    status: str
    wall_s: float
    num_variables: int
    num_constraints: int
    stats: dict = field(default_factory=dict)


class ShardingILP(LPRelaxation):
    """The model as plain rows over numbered variables, one constraint family per method; solved by
    CP-SAT (``solve_cpsat``), with GLOP's LP relaxation (``lp_relaxation``) as bound and warm start."""

    def __init__(self, graph: StrategyGraph):
        self.g = graph
        self.C = [[n.multiplicity * c for c in n.cost] for n in graph.nodes]
        self.M = [[n.multiplicity * m for m in n.memory] for n in graph.nodes]
        self.allowed = [n.choices() for n in graph.nodes]
        self.num_vars = 0
        self.x = [[self._new_var() for _ in n.cost] for n in graph.nodes]
        self.y = [[self._new_var() for _ in range(g.num_policies)] for g in graph.groups]
        self.edge_terms: list[tuple[SGEdge, dict]] = []  # edges kept as variables: (edge, {(p, q): var})
        self.rows: list[tuple[str, list[int], list[int], float, float]] = []  # (kind, vars, coefs, lo, hi)
        self.objective: tuple[list[int], list[int]] = ([], [])
        self.memory_row: Optional[int] = None
        self.memory_binding: Optional[bool] = None  # at the LP optimum (after ``lp_relaxation``)
        self.scale = 1.0
        self.memory_unit = 1.0
        self._lp = None  # GLOP, kept from the first ``solve_lp`` (with ``_lp_costs``, its objective)
        self._lp_costs: list[float] = []
        # the kept solver's variables that a Lagrangian price sets, and its rows, each handle made once
        # (``lp.variables()`` wraps all 34 K of a tiny Llama's anew, 0.09 CPU s, where 14 K are priced)
        self._lp_vars: dict = {}
        self._lp_rows: list = []
        self.lp_iterations: list[int] = []  # the simplex iterations of each LP solved on the kept solver
        self.lp_adopted = False  # whether the kept solver was another ILP's (``adopt_lp``), not built cold
        self._folds: list[Optional[list]] = []  # per edge of the graph, where ``_fold_edges`` put its prices
        self.capped = False  # whether ``add_cost_cap`` added its row
        #: whether the caller keeps this ILP to solve it again under lowered memory bounds (``ilp.solve(kept=)``,
        #: the planner's peak retries): its first LP then leaves a basis of the whole LP (``_COLD_KEPT``)
        self.solved_again = False
        self._row_terms: Optional[RowTerms] = None  # the rows' and objective's terms for CP-SAT, laid out once
        self._fold_edges()

    def _new_var(self) -> int:
        self.num_vars += 1
        return self.num_vars - 1

    def _classes(self, e: SGEdge) -> tuple[list[int], list[int]]:
        ps = sorted({e.u_class[s] for s in self.allowed[e.u]})
        qs = sorted({e.v_class[s] for s in self.allowed[e.v]})
        return ps, qs

    def _fold_edges(self) -> None:
        for e in self.g.edges:
            m = e.multiplicity
            ps, qs = self._classes(e)
            w = e.memory or [[0.0] * len(e.cost[0]) for _ in e.cost]
            if e.u == e.v:
                pairs = [(e.u, s, e.u_class[s], e.v_class[s]) for s in range(len(self.C[e.u]))]
            elif len(ps) == 1 or len(qs) == 1:
                node, fixed_p = (e.v, True) if len(ps) == 1 else (e.u, False)
                pairs = [(node, s, *((ps[0], e.v_class[s]) if fixed_p else (e.u_class[s], qs[0])))
                         for s in range(len(self.C[node]))]
            else:
                pairs = [(p, q) for p in ps for q in qs if not math.isinf(e.cost[p][q])]
                first = self.num_vars  # numbered in that order, as a _new_var per pair would
                self.num_vars += len(pairs)
                self.edge_terms.append((e, dict(zip(pairs, range(first, self.num_vars)))))
                pairs = None  # kept as variables
            self._folds.append(pairs)
            for node, s, p, q in pairs or ():
                self.C[node][s] += m * e.cost[p][q]
                self.M[node][s] += m * w[p][q]
            self._drop_infinite(e.u)
            self._drop_infinite(e.v)

    def _drop_infinite(self, i: int) -> None:
        """Exclude node ``i``'s strategies that folding left with an infinite (forbidden) cost."""
        keep = [s for s in self.allowed[i] if math.isfinite(self.C[i][s])]
        if len(keep) < len(self.allowed[i]):
            self.allowed[i] = keep

    # ---- constraint families -------------------------------------------------------------------
    def add_one_strategy_per_node(self) -> None:
        """(1) sum_s x[i,s] = 1."""
        for xs in self.x:
            self.rows.append(("exactly_one", xs, [1] * len(xs), 1, 1))

    def add_edge_consistency(self) -> None:
        """(2) transportation form: row p of e sums to the producer's class-p indicator, column q to
        the consumer's class-q indicator."""
        for e, evars in self.edge_terms:
            ps, qs = self._classes(e)
            for (p, q), var in evars.items():
                if p not in ps or q not in qs:  # a class a later fold excluded
                    self.rows.append(("linear", [var], [1], 0, 0))
            for p in ps:
                ys = [self.x[e.u][s] for s in self.allowed[e.u] if e.u_class[s] == p]
                es = [evars[p, q] for q in qs if (p, q) in evars]
                self.rows.append(("linear", es + ys, [1] * len(es) + [-1] * len(ys), 0, 0))
            for q in qs:
                zs = [self.x[e.v][s] for s in self.allowed[e.v] if e.v_class[s] == q]
                es = [evars[p, q] for p in ps if (p, q) in evars]
                self.rows.append(("linear", es + zs, [1] * len(es) + [-1] * len(zs), 0, 0))

    def add_policy_groups(self) -> None:
        """(5) one policy per group, and every member's strategy of that policy."""
        for g, group in enumerate(self.g.groups):
            ys = self.y[g]
            self.rows.append(("exactly_one", ys, [1] * len(ys), 1, 1))
            for i, pol in group.members.items():
                for r in range(group.num_policies):
                    xs = [self.x[i][s] for s in self.allowed[i] if pol[s] == r]
                    self.rows.append(("linear", xs + [ys[r]], [1] * len(xs) + [-1], 0, 0))

    def _memory_terms(self, unit: float) -> tuple[list[int], list[int]]:
        ids, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.M[i][s] / unit)
                if c:
                    ids.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.memory[p][q] / unit) if e.memory else 0
                if c:
                    ids.append(var)
                    coefs.append(c)
        return ids, coefs

    def add_memory_constraint(self) -> None:
        """(3) total bytes per device <= L, in units of L / 1e9 (no-op without a limit)."""
        limit = self.g.memory_limit
        if limit is None:
            return
        unit = self.memory_unit = limit / _SCALE_TARGET if limit > 0 else 1.0
        ids, coefs = self._memory_terms(unit)
        self.memory_row = len(self.rows)
        self.rows.append(("linear", ids, coefs, -math.inf, math.floor(limit / unit)))

    def add_pins(self) -> None:
        """(4) x[i,s] = 0 for strategies a pin (or a forbidden cost) excludes."""
        for i, xs in enumerate(self.x):
            keep = set(self.allowed[i])
            for s, var in enumerate(xs):
                if s not in keep:
                    self.rows.append(("linear", [var], [1], 0, 0))

    def set_objective(self, what: str = "cost") -> None:
        """Minimize estimated step time ("cost") or bytes per device ("memory"), scaled to integers
        so the largest possible total is about 1e9."""
        table = self.M if what == "memory" else self.C
        self._row_terms = None
        def edge_value(e, p, q):
            return (e.memory[p][q] if e.memory else 0.0) if what == "memory" else e.cost[p][q]

        upper = sum(max(table[i][s] for s in self.allowed[i]) for i in range(len(self.x)))
        upper += sum(e.multiplicity * max(edge_value(e, p, q) for p, q in evars)
                     for e, evars in self.edge_terms if evars)
        self.scale = _SCALE_TARGET / upper if upper > 0 else 1.0
        if what == "memory":
            self.objective = self._memory_terms(1.0 / self.scale)
            return
        ids, coefs = [], []
        for i, xs in enumerate(self.x):
            for s in self.allowed[i]:
                c = round(self.C[i][s] * self.scale)
                if c:
                    ids.append(xs[s])
                    coefs.append(c)
        for e, evars in self.edge_terms:
            for (p, q), var in evars.items():
                c = round(e.multiplicity * e.cost[p][q] * self.scale)
                if c:
                    ids.append(var)
                    coefs.append(c)
        self.objective = (ids, coefs)

    def add_cost_cap(self, nodes: set, edges: set, seconds: float) -> None:
        """(6) the cost counted over graph nodes ``nodes`` and edges ``edges`` (indices into the graph's
        ``edges``; an edge's price wherever ``_fold_edges`` put it) at most ``seconds``, in the
        objective's integer units rounded up by what rounding each term can add (``set_objective``
        first): a choice within ``seconds`` is never cut off."""
        coef: dict[int, float] = {}
        for i in nodes:
            m = self.g.nodes[i].multiplicity
            for s in self.allowed[i]:
                coef[self.x[i][s]] = coef.get(self.x[i][s], 0.0) + m * self.g.nodes[i].cost[s]
        terms = iter(self.edge_terms)
        for j, (e, folded) in enumerate(zip(self.g.edges, self._folds)):
            evars = next(terms)[1] if folded is None else None
            if j not in edges:
                continue
            m = e.multiplicity
            for (p, q), var in (evars.items() if evars is not None else ()):
                coef[var] = coef.get(var, 0.0) + m * e.cost[p][q]
            for node, s, p, q in folded or ():
                if s in self.allowed[node]:  # (a strategy folding made infinite is excluded)
                    var = self.x[node][s]
                    coef[var] = coef.get(var, 0.0) + m * e.cost[p][q]
        ids = [k for k, c in coef.items() if round(c * self.scale)]
        top = math.ceil(seconds * self.scale + 0.5 * (len(self.x) + len(self.edge_terms)) + 1)
        self.rows.append(("linear", ids, [round(coef[k] * self.scale) for k in ids], -math.inf, top))
        self.capped = True

    # ---- solving -------------------------------------------------------------------------------
    def choice_from(self, value: Callable[[int], float]) -> list[int]:
        return [max(self.allowed[i], key=lambda s: value(xs[s])) for i, xs in enumerate(self.x)]

    def set_memory_limit(self, limit: float) -> None:
        """Lower (or raise) the memory row's bound to ``limit`` bytes, in the units the row was built in
        (``add_memory_constraint``); the next solve answers under it. The ILP must have a memory row."""
        kind, ids, coefs, lo, _ = self.rows[self.memory_row]
        self.rows[self.memory_row] = (kind, ids, coefs, lo, math.floor(limit / self.memory_unit))
        self.g.memory_limit = limit

    def hint_literals(self, hint: list[int]) -> set[int]:
        """The variables set to 1 by the full choice ``hint`` (its strategies, edge pairs, policies)."""
        on = {self.x[i][s] for i, s in enumerate(hint)}
        for e, evars in self.edge_terms:
            on.add(evars.get((e.u_class[hint[e.u]], e.v_class[hint[e.v]]), -1))
        for g, group in enumerate(self.g.groups):
            r = group.policy_of(hint)
            if r is not None:
                on.add(self.y[g][r])
        on.discard(-1)
        return on

    def solve_cpsat(self, work_limit: float, workers: int, hint: Optional[list[int]] = None,
                    lower_bound: Optional[float] = None, fixed_zero: frozenset = frozenset(),
                    portfolio: bool = True, upper_bound: Optional[int] = None) -> ILPResult:
        """CP-SAT on the rows, warm-started from ``hint``; variables in ``fixed_zero`` are the constant 0
        (``memory_search.reduced_cost_fixings``); ``upper_bound``: only answers whose objective is at
        most this are wanted (INFEASIBLE when there is none). ``portfolio``: with ``workers > 1``,
        CP-SAT's interleaved portfolio of subsolvers; False: one sequential LP-guided search."""
        if self._row_terms is None or self._row_terms.num_rows != len(self.rows):
            self._row_terms = RowTerms(self.rows, self.objective)  # (a peak retry changes only a bound)
        model, index_of = cpsat_model(self.num_vars, self.rows, self.objective, fixed_zero, self._row_terms)
        if lower_bound is not None or upper_bound is not None:  # the LP bound, loosened against GLOP's tolerance
            lo = -2 ** 62 if lower_bound is None else math.floor(lower_bound - 1e-6 * abs(lower_bound) - 1)
            top = sum(c for c in self.objective[1] if c > 0)
            model.proto.objective.domain.extend([lo, top if upper_bound is None else min(top, int(upper_bound))])
        if hint is not None:
            on = self.hint_literals(hint)
            # what add_hint does var by var (a positive literal: its index, its value), in one call each:
            # a million Python calls across the stage planner's solves; the lists laid out by numpy
            free = np.ones(self.num_vars, dtype=bool)
            free[np.fromiter(fixed_zero, dtype=np.int64, count=len(fixed_zero))] = False
            ones = np.zeros(self.num_vars, dtype=np.int64)
            ones[np.fromiter(on, dtype=np.int64, count=len(on))] = 1
            model.proto.solution_hint.vars.extend(np.asarray(index_of, dtype=np.int64)[free].tolist())
            model.proto.solution_hint.values.extend(ones[free].tolist())
        solver = cp_model.CpSolver()
        # A work limit, not a clock: the same model gives the same answer however busy the machine
        # is. CP-SAT's deterministic time counts its own work units, about one second of a quiet core
        # each; with several workers, interleaved search keeps their schedule deterministic too.
        solver.parameters.max_deterministic_time = float(work_limit)
        workers = int(workers) if portfolio else 1
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = CPSAT_SEED
        if workers > 1:
            solver.parameters.interleave_search = True
            solver.parameters.share_binary_clauses = False
            # one subsolver chunk per worker per batch: by default a batch runs every full-problem
            # subsolver (six here) a chunk each, so a 2 s limit spent 6.5 s (GPT-3 175B's pipeline
            # candidates); the limit the planner hands out is then the work it gets
            solver.parameters.interleave_batch_size = int(workers)
        solver.parameters.relative_gap_limit = 1e-5
        # Presolve (probing, symmetry) costs seconds on these models and buys nothing once the LP
        # bound and a complete hint are given; measured on a Llama block: 11 s -> 0.1 s.
        solver.parameters.cp_model_presolve = False
        if not portfolio:  # the sequential search's root probing: a full work second per solve, for nothing
            solver.parameters.cp_model_probing_level = 0  # measured (memory_search): 7.1 -> 3.8 on a tiny Llama
            # the knapsack row's cuts at every node, not only the root: the tiny Llama's hardest memory-bound
            # solve proves the same optimum, with the same answer, in 2.8 work-s instead of 8.5
            solver.parameters.linearization_level = 2
        t0 = time.perf_counter()
        status = solver.solve(model)
        wall = time.perf_counter() - t0
        name = solver.status_name(status)
        ncons = len(model.proto.constraints)
        work = float(solver.response_proto.deterministic_time)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return ILPResult(None, math.inf, math.inf, name, wall, self.num_vars, ncons, {"work": work})
        values = solver.response_proto.solution
        choice = self.choice_from(lambda k: values[index_of[k]])
        cost, mem = self.g.evaluate(choice)
        return ILPResult(choice, cost, mem, name, wall, self.num_vars, ncons,
                         {"objective": solver.objective_value, "bound": solver.best_objective_bound, "work": work})
