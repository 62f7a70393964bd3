"""One pipeline candidate's intra-op plan (``plan_submesh``): the core planner's problem on a (dp, tp)
stage submesh, priced per microbatch as the stage scorer charges the profile ``layer_costs.profile_submesh``
makes of it (the pricing rules are in ``layer_costs``' module docstring), with the traced blocks counted
as often as the deep model has them (``CandidateSpec``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from autoshard.passes.cost.model import gradient_precision
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.levers import Levers, MixedPrecision
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins, PinError
from autoshard.passes.solve.clustering import OUTPUT, block_instance, cluster_edges, graph_edges, module_path
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.hint_plans import LazyHints, pinned_choices
from autoshard.passes.solve.ilp import solve
from autoshard.passes.solve.lever_search import free_forms
from autoshard.passes.solve.microbatch import MicrobatchCostModel, MicrobatchFacts, microbatch_strategies
from autoshard.passes.solve.problem import build_problem, strategy_choices
from autoshard.passes.solve.solution import Solution

__all__ = ["CandidateSpec", "plan_submesh"]


#: work-seconds each hinted layout's own (pinned, mostly fixed) solve may spend
_HINT_S = 0.5


@dataclass(frozen=True)
class CandidateSpec:
    """How one pipeline candidate's intra-op plan is priced (``plan_submesh``): at ``microbatches``
    microbatches, activations held ``held`` times; the real model has ``repeat`` times the traced blocks
    (their ILP nodes and the edges inside one block count that many times more); ``chain_repeat``: how
    many times more an edge from one traced block to the next counts (default ``repeat``; traced b of n
    blocks: (n - 1) / (b - 1)). ``mixed_precision``: how gradients are reduced and held
    (``PipelinePins.mixed_precision``), priced here and recorded in the plan's levers, which
    ``layer_costs.profile_submesh`` prices the profile by."""
    microbatches: int
    held: int
    repeat: float = 1.0
    chain_repeat: Optional[float] = None
    mixed_precision: Optional[MixedPrecision] = None


def plan_submesh(captured: CapturedGraph, mesh: Mesh, ctx: PlanContext, spec: CandidateSpec, *,
                 pins: Optional[Pins] = None, hints: Sequence[Pins] = (), memo: Optional[dict] = None) -> Solution:
    """The intra-op plan for the stages of a pipeline on ``mesh`` (see module docstring), priced as
    ``spec`` says on ``ctx``'s hardware and optimizer, within ``ctx``'s memory limit.
    ``ctx.time_limit_s`` caps the ILP solves together, in deterministic work (at least half a second each).
    The parameters may take ZeRO-1 / ZeRO-2 storage forms (``passes.sharding.storage_forms``; not
    ``once``, which ``held_reductions`` adds to finished plans), priced at ``microbatches`` per step
    (``passes.cost.storage_prices``; ``profile_submesh`` prices the chosen ones per microbatch and step).
    ``pins``: decisions fixed as in ``plan_sharding`` (e.g. to price a rejected layout). ``hints``: pins
    of known plans (a published layout of this submesh's shape): each is priced on the same ILP
    (``solve.hint_plans``) and the solve starts from, and never returns worse than, the best of them.

    When no plan fits the memory limit with activations held ``held`` times, the plan for ONE held
    microbatch (what a recomputing stage keeps), and failing that the least-memory plan (storage
    sharded wherever it can be, e.g. FSDP on the data-parallel axis): the stage ILP then decides
    whether recompute or more stages make it fit. ``solver_stats["status"]`` says which;
    ``solver_stats["work_s"]``: the deterministic seconds its solves spent.

    ``memo``: a dict the caller keeps for calls on the same ``captured``, submesh shape, ``ctx`` (but its
    memory and time limits), ``spec.microbatches`` and ``hints``, without ``pins`` (a candidate planned
    again: re-solved longer, under a leaner budget, re-planned to fit). The problem is built once,
    each strategy graph priced once per held count (limited anew per memory limit), and each hint solved once per graph and
    work limit (its work charged again as if solved): the answer is the one a fresh call gives."""
    hardware, optimizer, memory_limit, time_limit_s = ctx.spec, ctx.optimizer, ctx.memory_bytes, ctx.time_limit_s
    microbatches, held, repeat, chain_repeat = spec.microbatches, spec.held, spec.repeat, spec.chain_repeat
    left = [float(time_limit_s)]  # deterministic seconds still to spend: never the clock

    def budget(floor: float) -> float:
        return max(floor, left[0])

    def spend(result) -> None:
        left[0] -= float(result.stats.get("work", 0.0))

    def divisible_at_microbatch(table, mesh, allowed):
        for name, keep in microbatch_strategies(captured, table, mesh, microbatches).items():
            both = set(allowed.get(name, keep)) & keep
            if not both:
                raise PinError(f"the pins on {name!r} split its batch dimension more ways than a microbatch of "
                               f"1/{microbatches} of the batch has rows; pin fewer ways or use fewer microbatches")
            allowed[name] = both
        return free_forms(captured, table, allowed, microbatches)

    memo = memo if memo is not None and pins is None else {}
    problem = memo.get("problem")
    if problem is None:
        problem = memo["problem"] = build_problem(
            captured, mesh, hardware=hardware, pins=pins, facts=MicrobatchFacts(captured, hardware, microbatches),
            narrow=divisible_at_microbatch, choices=strategy_choices(captured, mesh, pins, storage_forms=True))
    mesh = problem.mesh
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    graph, result, status = None, None, None
    for k in dict.fromkeys((held, 1)):
        key = (k, memory_limit, repeat, chain_repeat)
        if ("graph",) + key in memo:
            graph = memo[("graph",) + key]
        else:
            # the prices do not read the memory limit: a candidate planned again under another budget (the
            # re-plans that fit its stages, the leaner finalist) reuses them, its graph only limited anew
            priced = memo.get(("priced", k, repeat, chain_repeat))
            if priced is None:
                # every parameter's optimizer step (1/m of it) and gradient accumulations ((m-1)/m of one) per
                # microbatch, as the stage scorer charges the profile's ``opt_step`` and ``accumulate`` per step:
                # without them the ILP chose weights replicated over tp whose 8x larger updates and accumulations
                # the stages then paid (Llama 3 405B, pp 16, (128, 8): 1.2 s per microbatch the ILP never saw)
                cm = MicrobatchCostModel(mesh, hardware, optimizer, microbatches, k,
                                         **gradient_precision(spec.mixed_precision))
                # the held count changes what nodes keep, not what edges cost: the second graph reuses the first's edges
                priced = problem.strategy_graph(cm, memory_limit, edges_from=graph)
                if repeat != 1.0:
                    _repeat(priced, problem.clustering, nodes, captured, repeat,
                            repeat if chain_repeat is None else chain_repeat)
                memo[("priced", k, repeat, chain_repeat)] = priced
            graph = memo[("graph",) + key] = replace(priced, memory_limit=memory_limit)
        hinted = []
        if hints:
            hint_s = min(_HINT_S, budget(0.1))

            def solve_hints(graph=graph, hint_s=hint_s, key=key):
                if ("hinted", hint_s) + key not in memo:
                    memo[("hinted", hint_s) + key] = pinned_choices(problem, graph, hints, time_limit_s=hint_s)
                return memo[("hinted", hint_s) + key]

            def charge(work):
                left[0] -= work

            # priced only when they can change the answer (``LazyHints``): as if solved first, else
            hinted = LazyHints(problem, graph, hints, solve_hints, charge, lambda: budget(0.5))
        result = solve(graph, time_limit_s=budget(0.5), hints=hinted)
        spend(result)
        if result.choice is not None:
            status = result.status if k == held else f"{result.status}_HELD_1"
            break
    if result.choice is None:
        result = solve(graph, objective="memory", time_limit_s=budget(1.0))
        spend(result)
        status = "MEMORY_FALLBACK"
    if result.choice is None:
        raise InfeasiblePlanError(f"the intra-op solver found no plan at all on submesh {mesh.shape} within "
                                  f"{time_limit_s} s ({result.status}); raise time_limit_s")
    stats = {"status": status, "solve_s": round(result.wall_s, 4), "objective": result.cost, "microbatches": microbatches,
             "held": held, "memory_limit": memory_limit, "work_s": round(float(time_limit_s) - left[0], 4)}
    return problem.solution(result.choice, optimizer=optimizer, solver_stats=stats,
                            levers=Levers(mixed_precision=spec.mixed_precision))


def _repeat(graph, clustering, nodes: dict, captured: CapturedGraph, repeat: float, chain: float) -> None:
    """Count every ILP node inside a numbered block ``repeat`` times more, and every edge as the deep
    model has it: inside one block instance ``repeat`` times, from one instance to another ``chain``
    times, once elsewhere (an ILP edge sums the graph edges between its two clusters)."""
    instance = {name: block_instance(module_path(node, captured)) for name, node in nodes.items()}
    inside = {i for i, sg in enumerate(graph.nodes) if instance.get(sg.name) is not None}
    for i in inside:
        graph.nodes[i].multiplicity = max(1, round(graph.nodes[i].multiplicity * repeat))
    weight: dict = {}
    for u, slot, v, k in graph_edges(captured):
        key = (clustering.cluster_of[u], slot, OUTPUT if v == OUTPUT else clustering.cluster_of[v], k)
        a, b = instance.get(u), None if v == OUTPUT else instance.get(v)
        w = 1.0 if a is None or b is None else repeat if a == b else chain
        weight[key] = weight.get(key, 0.0) + w
    keys = list(cluster_edges(graph_edges(captured), clustering))
    if len(keys) != len(graph.edges):
        raise AssertionError(f"{len(graph.edges)} ILP edges but {len(keys)} cluster edges: the strategy graph and "
                             "the clustering disagree")
    for e, key in zip(graph.edges, keys):
        e.multiplicity = max(1, round(weight[key]))
