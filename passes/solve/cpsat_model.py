"""The sharding ILP's rows written straight into a CP-SAT model proto, in bulk.

``cp_model.CpModel``'s Python calls (a ``new_bool_var`` or ``new_constant`` per variable, a
``weighted_sum`` and ``add_linear_constraint`` per row) cost a tiny Llama's memory-bound solve 0.3-0.4
CPU s each, about as much as CP-SAT's own search, and the planner makes a dozen such solves under a
binding ``memory_limit`` (issue 31, item 10). ``cpsat_model`` writes the proto those calls write, field
for field (checked against them in ``tests/passes/solve/test_solve_again.py``), so CP-SAT sees the same
model and answers the same:

- variable ``k`` is a 0-1 variable named ``v{k}``, except those in ``fixed_zero``, which all share the
  one constant-0 variable ``new_constant(0)`` makes at the first of them;
- an "exactly_one" row lists its literals as given (duplicates kept);
- a linear row, like the objective, merges repeated variables, drops zero coefficients and lists its
  variables in index order (what ``cp_model``'s flattening does), its domain ``[max(lo, -2**62), hi]``.

The linear rows' terms are merged and sorted for every row at once with numpy (``RowTerms``: the rows'
variables and coefficients laid out once per ILP, since its solves differ only in ``fixed_zero`` and the
rows' bounds): per row in Python that was most of a memory-bound solve's model (3,100 rows and 86 K
terms on a tiny Llama, 0.04 CPU s a model, 16 models a plan).
"""
from __future__ import annotations

from itertools import chain
from typing import Optional, Sequence

import numpy as np
from ortools.sat.python import cp_model

__all__ = ["cpsat_model", "RowTerms"]

_LOWEST = -2 ** 62


class RowTerms:
    """The terms of ``rows``' linear rows laid out flat (``rows``: ``ShardingILP.rows``): per term its
    row's ordinal among the linear rows, its variable and its coefficient; and ``objective``'s terms.
    Valid for any rows with the same kinds, variables and coefficients in the same order (only their
    bounds may differ) and the same objective."""

    def __init__(self, rows, objective: tuple[Sequence[int], Sequence[int]]):
        linear = [r for r in rows if r[0] != "exactly_one"]
        self.num_rows = len(rows)
        self.num_linear = len(linear)
        sizes = np.fromiter(map(len, (r[1] for r in linear)), dtype=np.int64, count=len(linear))
        count = int(sizes.sum())
        self.row = np.repeat(np.arange(len(linear), dtype=np.int64), sizes)
        self.var = np.fromiter(chain.from_iterable(r[1] for r in linear), dtype=np.int64, count=count)
        self.coef = _integers(chain.from_iterable(r[2] for r in linear), count)
        self.objective_var = np.asarray(objective[0], dtype=np.int64)
        self.objective_coef = _integers(objective[1], len(objective[0]))
        self.objective_row = np.zeros(len(objective[0]), dtype=np.int64)


def _integers(values, count: int) -> np.ndarray:
    """``[int(v) for v in values]`` as an int64 array (coefficients are integers; a float is truncated
    as ``int`` truncates it)."""
    values = list(values)
    if all(type(v) is int for v in values):
        return np.fromiter(values, dtype=np.int64, count=count)
    return np.fromiter((int(v) for v in values), dtype=np.int64, count=count)


def _merged(row: np.ndarray, var: np.ndarray, coef: np.ndarray, index_of: np.ndarray, width: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per term of rows ``row`` (ordinals) over ILP variables ``var``: the model variables
    (``index_of[var]``) merged within each row, coefficients summed, zero sums dropped, by (row, model
    variable): (rows, model variables, coefficients)."""
    key = row * width + index_of[var]
    order = np.argsort(key, kind="stable")
    key, coef = key[order], coef[order]
    if len(key) == 0:
        return key, key, coef
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    sums = np.add.reduceat(coef, starts)
    keys = key[starts]
    keep = sums != 0
    keys, sums = keys[keep], sums[keep]
    return keys // width, keys % width, sums


def cpsat_model(num_vars: int, rows, objective: tuple[Sequence[int], Sequence[int]],
                fixed_zero: frozenset = frozenset(), terms: Optional[RowTerms] = None
                ) -> tuple[cp_model.CpModel, list[int]]:
    """(the model minimising ``objective`` over ``rows`` (``ShardingILP.rows``: (kind, variables,
    coefficients, lo, hi)), each model variable's proto index by ILP variable). ``terms``: the rows'
    ``RowTerms`` when the caller keeps them (else laid out here)."""
    if terms is None or terms.num_rows != len(rows):
        terms = RowTerms(rows, objective)
    model = cp_model.CpModel()
    proto = model.proto
    fixed = np.zeros(num_vars, dtype=bool)
    if fixed_zero:
        fixed[np.fromiter(fixed_zero, dtype=np.int64, count=len(fixed_zero))] = True
    free = np.flatnonzero(~fixed)
    # variable k's place: the free variables before it, plus the constant when a fixed one came first
    where = np.cumsum(~fixed) - 1
    first = int(np.argmax(fixed)) if fixed_zero else num_vars  # every variable before it is free
    where[first:] += 1
    where[fixed] = first
    variables = proto.variables
    for k in free[:first].tolist():
        var = variables.add()
        var.name = f"v{k}"
        var.domain.extend((0, 1))
    if fixed_zero:
        variables.add().domain.extend((0, 0))
    for k in free[first:].tolist():
        var = variables.add()
        var.name = f"v{k}"
        var.domain.extend((0, 1))
    width = len(variables) + 1
    row, js, cs = _merged(terms.row, terms.var, terms.coef, where, width)
    ends = np.cumsum(np.bincount(row, minlength=terms.num_linear)).tolist()
    js, cs = js.tolist(), cs.tolist()
    constraints = proto.constraints
    ordinal, start = 0, 0
    for kind, ids, _, lo, hi in rows:
        if kind == "exactly_one":
            constraints.add().exactly_one.literals.extend(where[np.asarray(ids, dtype=np.int64)].tolist()
                                                          if len(ids) else ())
            continue
        end = ends[ordinal]
        linear = constraints.add().linear
        linear.vars.extend(js[start:end])
        linear.coeffs.extend(cs[start:end])
        linear.domain.extend((int(max(lo, _LOWEST)), int(hi)))
        ordinal, start = ordinal + 1, end
    _, vars_, coeffs = _merged(terms.objective_row, terms.objective_var, terms.objective_coef, where, width)
    proto.objective.vars.extend(vars_.tolist())
    proto.objective.coeffs.extend(coeffs.tolist())
    proto.objective.scaling_factor = 1.0
    return model, where.tolist()
