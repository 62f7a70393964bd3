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

Under a memory limit each solve is given the exposed-floor bound as a cap (``ilp.solve(cap=...)``): a
memory-bound search that would run long (a tiny GPT's layout: 2.5 work-s to prove an optimum whose floor
was above the bound, so discarded) is solved for the cheapest plan within the bound instead. Its answer,
if any, is one more finalist; a solve that ends quickly answers as without the cap.

When the search stopped at the plan without levers (its graph holds only the fastest policies), a
layout whose fastest-policy plan does not fit is tried under every policy only if that plan, priced
without the limit, beats the best finalist's overlapped step: its levered forms only add work.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

from autoshard.passes.sharding.pins import PinError, Pins
from autoshard.passes.solve.hint_plans import slice_graph
from autoshard.passes.solve.ilp import cost_floor
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph

__all__ = ["kept_strategies", "layout_finalists", "exposed_floor"]


def kept_strategies(problem, lever_graph, pins: Pins) -> Optional[list[list[int]]]:
    """Per node of ``lever_graph`` (a ``lever_graph.LeverGraph`` of ``problem``), the choices whose
    strategy ``pins`` allow every member of its cluster, under every policy of an expanded node (its
    choice ``r * S + s`` is strategy ``s`` of its table of ``S``); None when the pins do not hold here
    (a ``PinError``) or leave some node nothing."""
    try:  # the inputs first: a batch the layout's data axes do not divide fails there, at no cost
        Pins(inputs=pins.inputs).resolve(problem.captured, problem.table, problem.mesh)
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

    ``finalists``: the search's, in order; ``solve_policies(lever_graph, combos, policies, tighten, cap=,
    carry=)``: the planner's ``policy_solves.solve_policies`` with its budget, workers and no cutoff (each
    combination of each layout solved in a call of its own, one ``carry`` shared by the calls on one
    finalist's lever graph: a layout's ILP takes over the last one's LP solver, as the policy combinations'
    do; the layouts of a mesh's two axes have ILPs of one shape); ``evaluated(found)``: a
    record's priced ``Solution``; ``graph_of_every_policy(found)``: the lever graph of every policy at
    ``found``'s microstep count (for a search that stopped at its plan without levers)."""
    if not hints or not finalists:
        return []
    target = [min(_overlapped(evaluated(f)) for f in finalists)]  # the best overlapped step so far
    last_at = {}
    for f in finalists:
        last_at[f.k] = f
    out, seen = [], set()
    for base in last_at.values():
        wide = None  # the lever graph of every policy at base.k, built once when needed
        carry: dict = {}  # the last ILP solved on base's graph, whose LP solver the next one takes over
        for pins in hints:
            pins = _at_microsteps(pins, base.k)
            kept = kept_strategies(base.problem, base.lever_graph, pins)
            if kept is None:
                continue
            unfit: list[float] = []
            found = _solve_hint(search, base, kept, limit, solve_policies, evaluated, seen, target, unfit, carry)
            if not found and not _every_policy(search, base.lever_graph):
                # the search's graph of the fastest policies has no ILP memory limit: ``unfit`` holds the
                # overlapped step of the layout's fastest plan, which its levered plans can only exceed
                if unfit and min(unfit) < target[0]:
                    if wide is None:
                        wide = replace(base, lever_graph=graph_of_every_policy(base), solution=None)
                    wide_kept = kept_strategies(wide.problem, wide.lever_graph, pins)
                    if wide_kept is not None:
                        found = _solve_hint(search, wide, wide_kept, limit, solve_policies, evaluated, seen, target,
                                            [], carry)
            out.extend(found)
            target[0] = min([target[0]] + [_overlapped(evaluated(f)) for f in found])
    return out


def _at_microsteps(pins: Pins, k: int) -> Pins:
    """``pins`` as the ILP of ``k`` microsteps can take them: with one, ZeRO-1 runs exactly as ZeRO-2,
    which the search's graph holds in its place (``lever_search.free_forms``)."""
    if k != 1:
        return pins
    def two(value):  # a pin is a text, a Placement, or a tuple / list of them (``pins.parse_param_pin``)
        if isinstance(value, str):
            return value.replace("/zero1", "/zero2")
        if isinstance(value, (tuple, list)):
            return type(value)(two(v) for v in value)
        return value
    return replace(pins, params={name: two(v) for name, v in pins.params.items()})


def _every_policy(search, lever_graph) -> bool:
    """Whether ``lever_graph`` holds every policy the search allows (not only the fastest ones)."""
    have = {g.name: g.num_policies for g in lever_graph.graph.groups}
    return all(have.get(t, len(allowed)) == len(allowed) for t, allowed in search.policies.items())


def _overlapped(solution) -> float:
    est = getattr(solution, "estimated", None) or {}
    return float(est.get("overlapped_step_s", solution.estimated_step_time))


def exposed_floor(problem, lever_graph, choice: list[int], k: int) -> float:
    """A floor under the overlapped step of ``choice`` (of ``lever_graph``), read off the ILP's prices
    without pricing the plan: what its op nodes and the edges that do not leave a parameter cost, k
    times. Those are compute (recomputation included) and activation collectives, which the overlap
    model never hides (``passes/cost/overlap.py``: only parameter gathers, their re-gathers and the
    gradient reductions run on the communication stream); parameters' own prices (gradient syncs,
    storage forms, the optimizer step) and their gathers are left out."""
    graph = lever_graph.graph
    ops, params = _node_kinds(problem, lever_graph)
    total = sum(graph.nodes[i].multiplicity * graph.nodes[i].cost[choice[i]] for i in ops)
    for e in graph.edges:
        if e.u not in params:
            total += e.multiplicity * e.cost[e.u_class[choice[e.u]]][e.v_class[choice[e.v]]]
    return total * k


def _exposed_only(graph: StrategyGraph, problem, lever_graph) -> StrategyGraph:
    """``graph`` (a slice of ``lever_graph``'s) with every price ``exposed_floor`` leaves out set to 0:
    its ``ilp.cost_floor`` is a floor under the overlapped step of every choice, solver-free."""
    ops, params = _node_kinds(problem, lever_graph)
    nodes = [n if i in ops else SGNode(n.name, [0.0] * len(n.cost), n.memory, n.multiplicity, n.allowed)
             for i, n in enumerate(graph.nodes)]
    edges = [e if e.u not in params else SGEdge(e.u, e.v, e.u_class, e.v_class, [[0.0] * len(r) for r in e.cost],
                                                 e.memory, e.multiplicity, e.follow) for e in graph.edges]
    return StrategyGraph(nodes, edges, None, graph.groups)


def _node_kinds(problem, lever_graph) -> tuple[set, set]:
    """(ILP nodes that are op clusters, ILP nodes that hold a parameter)."""
    kind = problem.facts.kind
    ops, params = set(), set()
    for i, names in enumerate(lever_graph.members):
        if all(kind.get(n) == "op" for n in names):
            ops.add(i)
        if any(n in problem.captured.params for n in names):
            params.add(i)
    return ops, params


#: a layout's plan whose ``exposed_floor`` is within this share of the best overlapped step is priced
_FLOOR_SLACK = 1e-3


def _solve_hint(search, base, kept: list[list[int]], limit: Optional[float], solve_policies, evaluated,
                seen: set, target: list, unfit: list, carry: Optional[dict] = None) -> list:
    """The plans on ``base``'s lever graph within ``kept`` (``kept_strategies`` of a layout's pins),
    one per policy combination that fits ``limit`` (fastest first; a combination no faster in any
    block type than one that fitted is skipped), those already ``seen`` left out. ``limit`` None: only
    the fastest combination, solved and kept whatever its memory. A plan whose ``exposed_floor`` is
    above ``target[0]`` (the best overlapped step so far) cannot win and is not priced; when the floor of
    every choice within ``kept`` is (every node and edge at its cheapest), nothing is solved. ``unfit`` gets the overlapped steps of the
    plans priced that did not fit. ``carry``: ``solve_policies``'s, kept by the caller across layouts."""
    part = slice_graph(base.lever_graph.graph, kept)
    exposed = _exposed_only(part, base.problem, base.lever_graph)
    above = target[0] * (1 + _FLOOR_SLACK) / base.k
    # (the LP bound of that graph was tried too: on Llama-3 8B it pruned nothing and cost a third of the hints)
    if cost_floor(exposed) > above:
        return []
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
    cap = None
    if part.memory_limit is not None:
        # only plans whose exposed floor is within ``above`` are wanted: the ILP is told so (its optimum is
        # unchanged when it is not beaten; when it is, the old answer was discarded after a long search)
        ops, params = _node_kinds(base.problem, base.lever_graph)
        cap = (ops, {j for j, e in enumerate(part.edges) if e.u not in params}, above)
    k, cache, fitted, out = base.k, {}, [], []
    carry = {} if carry is None else carry  # each ILP takes over the last one's LP solver (``solve_policies``)

    def found_of(result):
        choice = tuple(keep[j] for keep, j in zip(kept, result.choice))
        if choice not in cache:
            cache[choice] = replace(base, result=replace(result, choice=list(choice)), step_time=result.cost * k,
                                    solution=None)
        return cache[choice]

    def beaten(result) -> bool:
        choice = [keep[j] for keep, j in zip(kept, result.choice)]
        return exposed_floor(base.problem, base.lever_graph, choice, k) > target[0] * (1 + _FLOOR_SLACK)

    def tighten(result):
        if limit is None or beaten(result):
            return None
        sol = evaluated(found_of(result))
        if sol.estimated_memory <= limit:
            return None
        return sum(sol.memory_breakdown.values()) - max(sol.estimated_memory - limit, 0.01 * limit)

    for combo in combos:
        if ordered_by_work and any(_dominated(combo, by) for by in fitted):
            continue
        for _, result in solve_policies(sliced_graph, [combo], policies, tighten, cap=cap, carry=carry):
            if result.choice is None:
                continue
            if beaten(result):  # and so is every combination it dominates (each only adds work)
                fitted.append(combo)
                continue
            found = found_of(result)
            if limit is not None and evaluated(found).estimated_memory > limit:
                unfit.append(_overlapped(evaluated(found)))
                continue
            fitted.append(combo)
            key = (k, tuple(found.result.choice))
            if key not in seen:
                seen.add(key)
                out.append(found)
    return out
