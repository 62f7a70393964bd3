"""The sharding ILP's rows written straight into a CP-SAT model proto, in bulk.

``cp_model.CpModel``'s Python calls (a ``new_bool_var`` or ``new_constant`` per variable, a
``weighted_sum`` and ``add_linear_constraint`` per row) cost a tiny Llama's memory-bound solve 0.3-0.4
CPU s each, about as much as CP-SAT's own search, and the planner makes a dozen such solves under a
binding ``memory_limit`` (issue 31, item 10). ``cpsat_model`` writes the proto those calls write, field
for field (checked against them in ``tests/passes/solve/test_cpsat_model.py``), so CP-SAT sees the same
model and answers the same:

- variable ``k`` is a 0-1 variable named ``v{k}``, except those in ``fixed_zero``, which all share the
  one constant-0 variable ``new_constant(0)`` makes at the first of them;
- an "exactly_one" row lists its literals as given (duplicates kept);
- a linear row, like the objective, merges repeated variables, drops zero coefficients and lists its
  variables in index order (what ``cp_model``'s flattening does), its domain ``[max(lo, -2**62), hi]``.
"""
from __future__ import annotations

from typing import Sequence

from ortools.sat.python import cp_model

__all__ = ["cpsat_model"]

_LOWEST = -2 ** 62


def _flat(indices: Sequence[int], coefs: Sequence[int], index_of: list[int]) -> tuple[list[int], list[int]]:
    """(variables, coefficients) of ``sum coefs[j] * var[indices[j]]`` merged, without zeros, by index."""
    js = [index_of[k] for k in indices]
    if len(set(js)) == len(js):  # nothing to merge (most rows): one sort, no dictionary
        pairs = sorted(zip(js, map(int, coefs)))
        return [j for j, c in pairs if c], [c for _, c in pairs if c]
    terms: dict[int, int] = {}
    for k, c in zip(indices, coefs):
        j = index_of[k]
        terms[j] = terms.get(j, 0) + int(c)
    order = sorted(j for j, c in terms.items() if c)
    return order, [terms[j] for j in order]


def cpsat_model(num_vars: int, rows, objective: tuple[Sequence[int], Sequence[int]],
                fixed_zero: frozenset = frozenset()) -> tuple[cp_model.CpModel, list[int]]:
    """(the model minimising ``objective`` over ``rows`` (``ShardingILP.rows``: (kind, variables,
    coefficients, lo, hi)), each model variable's proto index by ILP variable)."""
    model = cp_model.CpModel()
    proto = model.proto
    index_of: list[int] = [0] * num_vars
    constant = None
    variables = proto.variables
    for k in range(num_vars):
        if k in fixed_zero:
            if constant is None:
                constant = len(variables)
                variables.add().domain.extend((0, 0))
            index_of[k] = constant
            continue
        index_of[k] = len(variables)
        var = variables.add()
        var.name = f"v{k}"
        var.domain.extend((0, 1))
    constraints = proto.constraints
    for kind, ids, coefs, lo, hi in rows:
        if kind == "exactly_one":
            constraints.add().exactly_one.literals.extend(index_of[k] for k in ids)
            continue
        vars_, coeffs = _flat(ids, coefs, index_of)
        linear = constraints.add().linear
        linear.vars.extend(vars_)
        linear.coeffs.extend(coeffs)
        linear.domain.extend((int(max(lo, _LOWEST)), int(hi)))
    vars_, coeffs = _flat(objective[0], objective[1], index_of)
    proto.objective.vars.extend(vars_)
    proto.objective.coeffs.extend(coeffs)
    proto.objective.scaling_factor = 1.0
    return model, index_of
