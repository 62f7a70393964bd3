"""Published layouts of the mesh's shape as finalists of the plan without a pipeline.

The lever search (``planner._plan_within``) minimises the additive step; the overlap model then
re-ranks the plans it found (``finalists.pick_finalist``). A published layout (FSDP, Megatron's
tensor parallelism, ...) hides its parameter gathers and gradient reductions behind compute, so its
overlapped step can beat the additive optimum's while its additive step does not: the search never
keeps it, and the planner reported a plan worse than that layout under its own figure (issue 28).

``layout_finalists`` prices each layout's placements (``hints``: pins from ``HintsFor``, the front
door's ``layout_plans.mesh_layout_hints``) on the lever graph the search solved at each microstep
count of its finalists: every ILP node keeps only the strategies the pins allow (every policy of
them), and that much smaller problem is solved once per block-policy combination, fastest first,
under the same memory limit (a peak over it solved again below, as the search does). A combination
no faster in any block type than one that fitted is skipped: for the same placements each later
policy only adds work (recomputation, re-gathers, collectives issued again), and the overlap model
is non-decreasing in every kind of work. Each plan that fits becomes a finalist, so the plan
returned is never worse under the overlapped step than these layouts' placements with the
microstep counts and policies the search considered.

When the search stopped at the plan without levers (its graph holds only the fastest policies), a
layout whose fastest-policy plan does not fit is tried under every policy only if that plan, priced
without the limit, beats the best finalist's overlapped step: its levered forms only add work.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

from autoshard.passes.sharding.pins import PinError, Pins
from autoshard.passes.solve.hint_plans import _sliced
from autoshard.passes.solve.strategy_graph import StrategyGraph

__all__ = ["kept_strategies", "layout_finalists"]


def kept_strategies(problem, lever_graph, pins: Pins) -> Optional[list[list[int]]]:
    """Per node of ``lever_graph`` (a ``lever_graph.LeverGraph`` of ``problem``), the choices whose
    strategy ``pins`` allow every member of its cluster, under every policy of an expanded node (its
    choice ``r * S + s`` is strategy ``s`` of its table of ``S``); None when the pins do not hold here
    (a ``PinError``) or leave some node nothing."""
    try:
        allowed = Pins(params=pins.params, inputs=pins.inputs, ops=pins.ops).resolve(problem.captured, problem.table,
                                                                                     problem.mesh)
    except PinError:
        return None
    graph: StrategyGraph = lever_graph.graph
    kept = []
    for i, node in enumerate(graph.nodes):
        if i >= len(lever_graph.members):  # the program's outputs
            kept.append(node.choices())
            continue
        size = len(lever_graph.tables[i])
        keep = set(node.choices())
        for name in lever_graph.members[i]:
            if name in allowed:
                ok = set(allowed[name])
                keep = {c for c in keep if c % size in ok}
        if not keep:
            return None
        kept.append(sorted(keep))
    return kept


def _dominated(combo, by) -> bool:
    """Whether ``combo`` is at least as slow as ``by`` in every block type (policy indices ordered by
    work; ``None``: the joint combination, never compared)."""
    if combo is None or by is None:
        return False
    return all(r >= q for (_, r), (_, q) in zip(combo, by))


def layout_finalists(search, finalists: list, hints: Sequence[Pins], *, limit: float, solve_policies: Callable,
                     evaluated: Callable, graph_of_every_policy: Callable) -> list:
    """The plans of ``hints``' placements that fit ``limit`` (module docstring), as the planner's
    ``_Found`` records (copies of a finalist with another result), in hint order.

    ``finalists``: the search's, in order; ``solve_policies(lever_graph, combos, policies, tighten)``:
    the planner's ``_solve_policies`` with its budget, workers and no cutoff; ``evaluated(found)``: a
    record's priced ``Solution``; ``graph_of_every_policy(found)``: the lever graph of every policy at
    ``found``'s microstep count (for a search that stopped at its plan without levers)."""
    if not hints or not finalists:
        return []
    target = min(_overlapped(evaluated(f)) for f in finalists)
    last_at = {}
    for f in finalists:
        last_at[f.k] = f
    out, seen = [], set()
    for base in last_at.values():
        for pins in hints:
            found = _solve_hint(search, base, pins, limit, solve_policies, evaluated, seen)
            if not found and not _every_policy(search, base.lever_graph):
                probe = _solve_hint(search, base, pins, None, solve_policies, evaluated, set())
                if probe and _overlapped(evaluated(probe[0])) < target:
                    wide = replace(base, lever_graph=graph_of_every_policy(base), solution=None)
                    found = _solve_hint(search, wide, pins, limit, solve_policies, evaluated, seen)
            out.extend(found)
    return out


def _every_policy(search, lever_graph) -> bool:
    """Whether ``lever_graph`` holds every policy the search allows (not only the fastest ones)."""
    have = {g.name: g.num_policies for g in lever_graph.graph.groups}
    return all(have.get(t, len(allowed)) == len(allowed) for t, allowed in search.policies.items())


def _overlapped(solution) -> float:
    est = getattr(solution, "estimated", None) or {}
    return float(est.get("overlapped_step_s", solution.estimated_step_time))


def _solve_hint(search, base, pins: Pins, limit: Optional[float], solve_policies, evaluated, seen: set) -> list:
    """``pins``' plans on ``base``'s lever graph, one per policy combination that fits ``limit``
    (fastest first; a combination no faster in any block type than one that fitted is skipped), those
    already ``seen`` left out. ``limit`` None: only the fastest combination, solved and kept whatever
    its memory."""
    kept = kept_strategies(base.problem, base.lever_graph, pins)
    if kept is None:
        return []
    part = _sliced(base.lever_graph.graph, kept)
    if limit is None:
        part.memory_limit = None
    if not part.groups:
        policies, combos = search.policies, [None]
    elif _every_policy(search, base.lever_graph) and limit is not None:
        policies, combos = search.policies, search.combinations()
    else:  # the fastest policies only (the graph may hold nothing else)
        policies = {g.name: [search.policies[g.name][0]] for g in part.groups}
        combos = [tuple(sorted((t, allowed[0]) for t, allowed in policies.items()))]
    ordered_by_work = all(list(a) == sorted(a) for a in search.policies.values())
    sliced_graph = replace(base.lever_graph, graph=part)
    k, cache, fitted, out = base.k, {}, [], []

    def found_of(result):
        choice = tuple(keep[j] for keep, j in zip(kept, result.choice))
        if choice not in cache:
            cache[choice] = replace(base, result=replace(result, choice=list(choice)), step_time=result.cost * k,
                                    solution=None)
        return cache[choice]

    def tighten(result):
        if limit is None:
            return None
        sol = evaluated(found_of(result))
        if sol.estimated_memory <= limit:
            return None
        return sum(sol.memory_breakdown.values()) - max(sol.estimated_memory - limit, 0.01 * limit)

    for combo in combos:
        if ordered_by_work and any(_dominated(combo, by) for by in fitted):
            continue
        for _, result in solve_policies(sliced_graph, [combo], policies, tighten):
            if result.choice is None:
                continue
            found = found_of(result)
            if limit is not None and evaluated(found).estimated_memory > limit:
                continue
            fitted.append(combo)
            key = (k, tuple(found.result.choice))
            if key not in seen:
                seen.add(key)
                out.append(found)
    return out
