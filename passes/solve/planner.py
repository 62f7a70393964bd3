"""The planner: strategies -> prices -> clusters -> ILP -> Solution, memory levers included.

>>> sol = plan_sharding(captured, Mesh.of((2, 2)), PlanContext.of("h100"), levers=LeverPins())  # doctest: +SKIP
>>> sol.param_placements["fc1.weight"], sol.levers.accumulation, sol.solver_stats["status"]  # doctest: +SKIP
((R, S(0)), 1, 'OPTIMAL')

``plan_sharding`` minimizes the estimated step time under a per-device memory limit (default: the
hardware's memory) and raises ``InfeasiblePlanError`` when nothing fits, after solving again for
the smallest memory any plan needs. The ILP has one node per cluster of identical layer nodes
(``clustering``), views and other followers folded into their producers
(``strategy_graph.merge_followers``), so a 32-layer model solves as fast as a 2-layer one.

Memory levers (``levers=LeverPins(...)``; None: none pulled, as the pipeline planner's stages want):

- each repeated-block type's policy (keep / reshard after forward / selective / full
  checkpointing) is chosen in the ILP itself (``lever_graph``, priced by ``lever_costs``);
- gradient accumulation ``k`` is searched outside it: for every divisor of the global batch the
  pins allow, the problem is priced per microstep (``microbatch``: batch-dependent work and bytes
  divided by k, gradient syncs once per step, only strategies that still divide the microbatch) and
  solved; a candidate whose LP bound cannot beat the best step so far is skipped (status CUTOFF),
  and a count whose fastest policies' cost floor cannot is skipped before its graph of every policy
  is priced (``_cut_off_unpriced``);
  the fastest plan that fits wins. Never for a program with batch-coupled ops (BatchNorm in
  training, reductions over the batch: ``passes.batch_coupling``), whose maths microsteps would
  change; a pinned count there warns (``BatchCouplingWarning``);
- no lever is pulled when the plan without levers fits: it is solved first, without the memory
  limit (``_solve_unlevered``);
- storage forms (``storage_forms=``): ZeRO-1/2 per parameter and axis in the ILP, with placements;
  FSDP gradients reduced once per step under accumulation after it, where memory allows
  (``held_reductions``);
- mixed precision is the user's: the program must have been captured computing in its
  ``param_dtype`` (``capture(..., param_dtype=)``); the cost model keeps parameters, gradients and
  optimizer state in the parameters' own dtype and reduces gradients in ``reduce_dtype``.

Solves are bounded by deterministic work (CP-SAT deterministic time, fixed seed and workers), never
by the clock, so a plan does not depend on the machine's load; ``solver_stats["gap"]`` is the
chosen solve's relative optimality gap.

The plan is priced with ``solution.evaluate``, the same cost model the ILP sees, on the hardware and
optimizer asked for (as ``random_plans.random_solution`` prices random valid plans). The program's
planning context (strategy table, blocks, policies, microstep counts) is ``lever_search.LeverSearch``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from autoshard.passes.batch_coupling import describe_coupled
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import chosen_keywords

from autoshard.passes.sharding.pins import HintsFor, PinError, Pins
from autoshard.passes.solve.ilp import ILPResult, cost_floor, lp_bound, memory_floor
from autoshard.passes.solve.lever_costs import LeverPricer
from autoshard.passes.solve.finalists import pick_finalist
from autoshard.passes.solve.layout_finalists import layout_finalists
from autoshard.passes.solve.held_reductions import hold_reductions
from autoshard.passes.solve.lever_search import LeverSearch
from autoshard.passes.solve.lever_graph import LeverGraph, node_cost_floor
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.policy_solves import solve_policies
from autoshard.passes.solve.strategy_graph import fix_policies
from autoshard.passes.solve.work_budget import WorkBudget, solve_gap
from autoshard.passes.solve.problem import ShardingProblem
from autoshard.passes.solve.solution import Solution, evaluate, node_policy, pricing_for
from autoshard.passes.spec import fmt_placements
from autoshard.passes.units import human_bytes
from autoshard.passes.gc_pauses import fewer_gc_pauses

__all__ = ["plan_sharding"]


@dataclass
class _Found:
    k: int
    problem: ShardingProblem
    lever_graph: LeverGraph
    result: ILPResult
    step_time: float
    solution: Optional[Solution] = None  # evaluated (its whole-step peak), once


@fewer_gc_pauses
def plan_sharding(captured: CapturedGraph, mesh, ctx: Optional[PlanContext] = None, *,
                  pins: Optional[Pins] = None, levers: Optional[LeverPins] = None,
                  traced_at_microbatch: bool = False, explain: bool = True,
                  storage_forms: Optional[bool] = None, hints_for: Optional[HintsFor] = None) -> Solution:
    """The cheapest plan (estimated step time) whose whole-step memory peak fits ``ctx``'s memory limit
    per device, priced on its hardware and optimizer (``ctx``: the settings every planner reads, built
    once by the front door; None: the default context, ``PlanContext.of()``).

    ``levers``: which memory levers the planner chooses (``LeverPins()``: all) and which are pinned;
    None pulls none. ``traced_at_microbatch``: ``captured`` holds one microstep of
    ``levers.accumulation`` (the runtime's program), not the global batch. ``ctx.time_limit_s`` bounds
    the solves together as a WORK limit (CP-SAT deterministic seconds, about wall seconds on a quiet
    core), so the same inputs give the same plan however busy the machine is.

    Levers are pulled only when they pay or are needed to fit: the plan without levers (the
    fastest policies the pins allow, the fewest microsteps) is solved first without the memory
    limit, and when its peak fits, it is the answer (each lever only adds work). Accumulation is
    never chosen for a program with batch-coupled ops (``passes.batch_coupling``); a pinned one
    warns. ``solver_stats["gap"]``: the chosen solve's relative gap between its plan and its proven
    bound.

    The ILP prices memory additively (each node's and edge's bytes summed); the plan's
    ``estimated_memory`` is the step's peak (``peak_timeline``), which can exceed that sum (gradients
    in flight, optimizer temporaries, the batch). Each answer of the ILP (one per microstep count
    and block-policy combination) is evaluated; one whose peak exceeds the limit is solved again
    with the ILP's limit below that answer's additive bytes by the excess (at least ``_PEAK_STEP``
    of the limit), up to ``policy_solves.PEAK_RETRIES`` times. Only a plan whose peak fits is returned
    (else ``InfeasiblePlanError``, which says what the smallest plan needs and its largest items;
    ``explain=False`` skips pricing that (seconds on a deep model) for a caller that only needs to
    know nothing fits).

    ``storage_forms``: the parameters may also take ZeRO-1/2 and reduce-once storage forms
    (``passes.sharding.storage_forms``), chosen per parameter and axis like placements; None: when
    ``levers`` is given (``levers=None`` plans as before levers existed, as the pipeline planner's
    stages want: their runtime runs plain forms only).

    ``hints_for(captured, mesh)``: pins of known plans of this mesh's shape (the published layouts'
    placements): each is priced at the search's microstep counts and policies and enters the overlap
    re-rank as a finalist (``layout_finalists``), so the plan is never worse under the overlapped step
    than they are."""
    ctx = PlanContext.given(ctx)
    forms = levers is not None if storage_forms is None else storage_forms
    search = LeverSearch(captured, mesh, ctx, pins, LeverPins.off() if levers is None else levers,
                         traced_at_microbatch, forms)
    return _plan_within(search, ctx, explain=explain, hints_for=hints_for)


#: CP-SAT workers of every solve: fixed, like its seed, so the same inputs give the same plan
_WORKERS = 2


#: how many times one policy combination is solved again with a tighter ILP limit when its plan's
#: peak exceeds the limit, each time at least this fraction of the limit below the additive bytes
#: of the plan that failed
_PEAK_STEP = 0.01


def _plan_within(search: LeverSearch, ctx: PlanContext, prune: bool = True, explain: bool = True,
                 hints_for: Optional[HintsFor] = None) -> Solution:
    """``plan_sharding`` of ``search``'s program, pins and levers within ``ctx``'s memory limit (in bytes)
    and work budget. ``prune=False`` (for
    tests): no bound skips anything (no plan without levers first, no cutoff, no proven-fastest stop,
    no multiples of a cut-off microstep count): every microstep count and policy combination is
    solved, and the fastest that fits wins, in the same order of preference."""
    t0 = time.perf_counter()
    budget = WorkBudget(ctx.time_limit_s)
    limit, workers = ctx.memory_bytes, _WORKERS
    ks = search.accumulations()
    combos = search.combinations()
    best: Optional[_Found] = None
    finalists: list[_Found] = []  # every plan that fit and became the additive best, in order
    tried: dict[int, str] = {}
    pruned: dict[tuple, list[int]] = {}  # combination -> k's whose multiples cannot beat the best
    last = None
    unlevered = _solve_unlevered(search, ks, budget, workers, limit) if prune else None
    at_floor = _FloorCheck(combos, search.policies, unlevered)
    if unlevered is not None and unlevered.result.memory > limit:
        unlevered = None  # its additive bytes do not fit: levers are needed
    if unlevered is not None and _evaluated(search, unlevered).estimated_memory > limit:
        unlevered = None  # its additive bytes fit, its peak does not: the search below tightens
    if unlevered is not None:
        best = unlevered
        finalists.append(best)
        tried[ks[0]] = "UNCONSTRAINED/" + unlevered.result.status
        tried.update({k: "NOT_NEEDED" for k in ks[1:]})  # more microsteps only add work
    for k in ([] if unlevered is not None else ks):
        todo = [c for c in combos if not any(k % k0 == 0 for k0 in pruned.get(c, ()))]
        if at_floor(best):
            todo = []  # the best found is provably the fastest plan
        if not todo:
            tried[k] = "PRUNED"
            continue
        try:
            problem, cm = search.problem(k)
        except PinError:
            if len(ks) == 1:
                raise
            tried[k] = "PINNED_OUT"
            continue
        if prune and best is not None and k != ks[0] and _cut_off_unpriced(search, problem, cm, best.step_time, k):
            tried[k] = "/".join("CUTOFF" for _ in todo)  # what solving each combination would answer
            for combo in todo:
                pruned.setdefault(combo, []).append(k)
            continue
        graph = search.graph(problem, cm, limit)
        last = (k, problem, graph)
        if prune and k == ks[0] and ks[0] == 1:
            at_floor.graph = graph
        statuses = []
        priced: dict[int, tuple[ILPResult, _Found]] = {}  # the answers ``tighten`` priced, by id

        def tighten(result, k=k, problem=problem, graph=graph):
            """The ILP bounds additive bytes: a plan whose peak exceeds the limit is solved again
            below its own additive bytes by the excess (at least ``_PEAK_STEP`` of the limit), or, when
            the excess is more than those bytes, at those bytes times limit / peak."""
            found = priced[id(result)] = (result, _Found(k, problem, graph, result, result.cost * k))
            sol = _evaluated(search, found[1])
            if sol.estimated_memory <= limit:
                return None
            # the ILP's own additive bytes (what its limit bounds: a zero1 gradient held over the
            # microsteps included, which the breakdown's categories leave out)
            additive = result.memory
            lower = additive - max(sol.estimated_memory - limit, _PEAK_STEP * limit)
            # terms outside the additive sum larger than the sum itself (a small model's ZeRO buckets and
            # whole gradients): cut the sum in the proportion the peak exceeds the limit instead of giving up
            return lower if lower > 0 else additive * limit / sol.estimated_memory

        def cutoff(k=k):
            return None if best is None or not prune else best.step_time / k

        for combo, result in solve_policies(graph, todo, search.policies, budget, workers, cutoff, tighten=tighten):
            statuses.append(result.status)
            if result.status == "CUTOFF" and not result.stats.get("memory_binding", True):
                # the bound ignores memory, and a plan of k' = multiple of k microsteps runs as a plan
                # of k no slower: no multiple of k can beat the best with this combination either
                pruned.setdefault(combo, []).append(k)
            if result.choice is not None and (best is None or result.cost * k < best.step_time * (1 - _PAYS)):
                hit = priced.get(id(result))  # the last answer of a combination: ``tighten`` priced it
                found = hit[1] if hit is not None and hit[0] is result else _Found(k, problem, graph, result,
                                                                                    result.cost * k)
                if _evaluated(search, found).estimated_memory <= limit:
                    best = found
                    finalists.append(best)
            if at_floor(best):
                break  # provably the fastest plan
        tried[k] = "/".join(statuses)
    if finalists:  # the ILP ranks by the additive sum; the overlap model picks among what it found
        hinted = _hinted(search, finalists, hints_for, limit, budget, workers)
        best, rescored = pick_finalist(finalists + hinted, lambda f: _evaluated(search, f),
                                       additive_index=len(finalists) - 1)
    status = None if best is None else best.result.status
    if best is None:
        if last is None:
            raise InfeasiblePlanError("no microstep count allows a plan: " + repr(tried))
        k, problem, graph = last  # the most microsteps: the least activation memory
        if not explain and memory_floor(graph.graph) > limit:
            # every plan's bytes exceed the limit (the floor is below the smallest plan's), and the error
            # will not name what the smallest needs: its search (2.3 CPU s for Llama 3 405B's plan without
            # a pipeline, which plan_pipeline asks for) decides nothing
            raise _infeasible(search, k, problem, graph, None, limit, explain)
        found = [r for _, r in solve_policies(graph, combos, search.policies, budget, workers, lambda: None,
                                               objective="memory") if r.choice is not None]
        smallest = min(found, key=lambda r: r.memory) if found else None
        if smallest is None or smallest.memory > limit:
            raise _infeasible(search, k, problem, graph, smallest, limit, explain)
        best, status = _Found(k, problem, graph, smallest, smallest.cost * k), "MEMORY_FALLBACK"
        if _evaluated(search, best).estimated_memory > limit:
            raise _infeasible(search, k, problem, graph, smallest, limit, explain)
    sol = _evaluated(search, best)
    if search.storage_forms:  # FSDP gradients reduced once per step where memory allows
        sol = hold_reductions(sol, search.captured, set(search.choices[2]) & set(search.captured.params), limit,
                              lambda strategies: evaluate(search.captured, search.mesh, strategies, search.ctx,
                                                          unruled=best.problem.table.unruled,
                                                          levers=sol.levers,
                                                          traced_at_microbatch=search.traced_at_microbatch))
    clustering = best.problem.clustering
    stats = {"status": status, "wall_s": round(time.perf_counter() - t0, 4), "solve_s": round(best.result.wall_s, 4),
             "work_s": round(budget.spent, 4), "gap": solve_gap(best.result),
             "variables": best.result.num_variables, "constraints": best.result.num_constraints,
             "clusters": clustering.num_clusters, "nodes": sum(len(m) for m in clustering.members),
             "ilp_nodes": best.result.stats.get("ilp_nodes"), "ilp_edges": len(best.lever_graph.graph.edges),
             "objective_s": best.step_time, "accumulation_tried": {str(k): v for k, v in tried.items()}}
    if finalists:
        stats["finalists"] = rescored
    search.warn_if_coupled(best.k, stats)
    sol.solver_stats = dict(stats, **{k: v for k, v in sol.solver_stats.items() if k == "held_reductions"})
    return sol


def _hinted(search: LeverSearch, finalists: list[_Found], hints_for: Optional[HintsFor], limit: float,
            budget: WorkBudget, workers: int) -> list[_Found]:
    """The plans of the published layouts' placements ``hints_for`` gives (``layout_finalists``)."""
    hints = hints_for(search.captured, search.mesh) if hints_for is not None else ()
    if not hints:
        return []

    def every_policy(found: _Found) -> LeverGraph:
        problem, cm = search.problem(found.k)
        return search.graph(problem, cm, limit)

    return layout_finalists(search, finalists, hints, limit=limit, evaluated=lambda f: _evaluated(search, f),
                            solve_policies=lambda graph, combos, policies, tighten, cap=None, carry=None: solve_policies(
                                graph, combos, policies, budget, workers, lambda: None, tighten=tighten, cap=cap,
                                carry=carry),
                            graph_of_every_policy=every_policy)


def _evaluated(search: "LeverSearch", found: _Found) -> Solution:
    """``found``'s assignment priced by ``evaluate`` (its peak included), worked out once."""
    if found.solution is None:
        strategies, policies = found.lever_graph.decode(found.result.choice)
        found.problem.settle_inputs(strategies)
        found.solution = evaluate(search.captured, search.mesh, strategies, search.ctx,
                                  unruled=found.problem.table.unruled, levers=search.levers_of(found.k, policies),
                                  traced_at_microbatch=search.traced_at_microbatch)
    return found.solution


# A lever choice replaces the incumbent only when it is faster by more than this share: equal
# estimates (a lever that changes nothing, e.g. resharding replicated weights) keep the levers off.
_PAYS = 1e-9


def _solve_unlevered(search: "LeverSearch", ks: list[int], budget: WorkBudget, workers: int,
                     limit: Optional[float] = None) -> Optional[_Found]:
    """The fastest plan without levers (the fewest microsteps, the fastest policies the pins allow),
    solved without the memory limit on a lever graph of those policies alone, whatever its memory
    (None when the pins leave none). When it fits the limit it is the answer: every lever only adds
    work to a plan (``_fastest_bound``), so no lever can beat it, and pulling one then would only be
    an artefact of comparing solves that stopped short of their optimum. None, unsolved, when the
    graph's memory floor (``ilp.memory_floor``, below the bytes of every answer) exceeds ``limit``:
    its answer could not fit, and the caller drops such an answer (Llama 3 405B without a pipeline:
    4.5 CPU s, 5.8 work-s, for a plan far over the limit)."""
    k = ks[0]
    try:
        problem, cm = search.problem(k)
    except PinError:
        return None
    fastest, only, graph = _fastest_graph(search, problem, cm)
    if limit is not None and memory_floor(graph.graph) > limit:
        return None
    for _, result in solve_policies(graph, [fastest], only, budget, workers, lambda: None):
        if result.choice is not None:
            return _Found(k, problem, graph, result, result.cost * k)
    return None

def _fastest_graph(search: "LeverSearch", problem: ShardingProblem, cm) -> tuple[tuple, dict, LeverGraph]:
    """(the fastest policy combination, its policies as ``build_lever_graph`` takes them, the lever
    graph of those policies alone, without a memory limit)."""
    fastest = tuple((t, allowed[0]) for t, allowed in sorted(search.policies.items()))  # KEEP unless pinned
    # priced for the fastest policies only: the graph of every policy costs each block type's ops and
    # edges once per policy (3.6 of 9.6 profiled seconds for Llama-3 8B on (8, 8)), to solve one slice
    only = {t: [r] for t, r in fastest}
    graph = search.lever_graph(problem, cm, only, None)
    return fastest, only, graph


def _cut_off_unpriced(search: "LeverSearch", problem: ShardingProblem, cm, best_step: float, k: int) -> bool:
    """Whether no plan of ``k`` microsteps, of any policy, can beat ``best_step``, shown by the
    solver-free cost floor (``ilp.cost_floor``: every node and edge at its cheapest) of the graph
    of the fastest policies alone, priced at a fraction of the cost of the graph of every policy.
    Every policy after the first allowed one only adds work to each node and edge
    (``lever_costs.LeverPricer``: recomputation, gathers and collectives issued again), so that floor
    is at most the floor of every policy combination's graph, with which ``ilp.solve`` would answer
    each combination "CUTOFF" (its memory bound ignored: no multiple of ``k`` can beat the best)."""
    if any(list(allowed) != sorted(allowed) for allowed in search.policies.values()):
        return False  # the first allowed policy is not the cheapest: no claim
    fastest = {t: [allowed[0]] for t, allowed in search.policies.items()}
    if node_cost_floor(problem, search.pricer(problem, cm), fastest) >= best_step / k * (1 - 1e-6):
        # its nodes alone (edges only add): a tiny model's count of 2 microsteps is cut off here, before
        # its edges are priced (a tiny Llama: 0.2 of 0.22 CPU s)
        return True
    _, _, graph = _fastest_graph(search, problem, cm)
    return cost_floor(graph.graph) >= best_step / k * (1 - 1e-6)


class _FloorCheck:
    """``check(best)``: whether ``best`` is provably the fastest plan, its step within 1e-6 of
    ``_fastest_bound`` on ``graph`` (the one-microstep lever graph; None: no bound). The bound's LP
    is solved only when it can decide: the plan without levers, solved to optimality on the same
    costs, is at least the bound, so a best more than 0.1 % slower than it is never within 1e-6 of
    the bound (a binding memory limit's search otherwise pays an LP whose answer it never uses)."""

    def __init__(self, combos: list, policies: dict[str, list[int]], unlevered: Optional["_Found"]):
        self.combos, self.policies, self.graph = combos, policies, None
        optimal = unlevered is not None and unlevered.k == 1 and unlevered.result.status == "OPTIMAL"
        self.above = unlevered.step_time * (1 + 1e-3) if optimal else None
        self.floor: Optional[float] = None
        self.solved = False

    def __call__(self, best: Optional["_Found"]) -> bool:
        if best is None or self.graph is None:
            return False
        if not self.solved:
            if self.above is not None and best.step_time > self.above:
                return False
            self.floor, self.solved = _fastest_bound(self.graph, self.combos, self.policies), True
        return self.floor is not None and best.step_time <= self.floor * (1 + 1e-6)


def _fastest_bound(graph: LeverGraph, combos: list, policies: dict[str, list[int]]) -> Optional[float]:
    """A lower bound on the step time of every plan, whatever its levers: the LP bound, without the
    memory limit, of the fastest policy combination at one microstep. For one assignment of
    strategies, keeping everything is no slower than resharding, resharding than selective, selective
    than full recomputation (each adds work), and a plan of k microsteps runs as a plan of one no
    slower (its fixed costs repeat k times); without the memory limit the fastest combination's
    optimum is therefore below every plan's step time."""
    first = combos[0]
    if first is None:
        part = graph.graph
    else:
        chosen = dict(first)
        part, _ = fix_policies(graph.graph, [policies[g.name].index(chosen[g.name]) for g in graph.graph.groups])
    return lp_bound(part)


def _infeasible(search: LeverSearch, k: int, problem: ShardingProblem, graph: LeverGraph,
                smallest: Optional[ILPResult], limit: float, explain: bool = True) -> InfeasiblePlanError:
    mesh = search.mesh
    if not explain:
        return InfeasiblePlanError(f"no plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on "
                                   f"mesh {mesh.shape} (plan_sharding(explain=True) says what the smallest plan needs)")
    if smallest is None:
        return InfeasiblePlanError(
            f"no plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on mesh {mesh.shape}, "
            f"and the solver could not find the smallest plan in time; raise time_limit_s, "
            "use more devices or a larger memory_limit")
    strategies, policies = graph.decode(smallest.choice)
    levers = search.levers_of(k, policies)
    sol = evaluate(search.captured, mesh, strategies, search.ctx, unruled=problem.table.unruled,
                   levers=levers, traced_at_microbatch=search.traced_at_microbatch)
    need = sol.estimated_memory
    parts = ", ".join(f"{key} {human_bytes(v)}" for key, v in
                      sorted(sol.memory_breakdown.items(), key=lambda kv: -kv[1]) if v)
    _, cm = pricing_for(search.captured, mesh, search.hw, search.optimizer, k, search.levers.mixed_precision,
                        search.traced_at_microbatch)
    pricer = LeverPricer(search.captured, problem.facts, cm, search.blocks)
    big = []
    for name, s in sol.strategies.items():
        base, price = pricer.node(name, s, node_policy(name, levers, search.blocks, problem.facts))
        label = search.captured.params.get(name) or name
        big.append((base.params + base.grads + base.optimizer + price.memory, label,
                    problem.facts.tensor_outputs(name), s))
    big.sort(key=lambda t: -t[0])
    tops = "; ".join(f"{label} {tuple(m[0].shape) if m else ''} {fmt_placements(s.outputs[0]) if s.outputs else ''}"
                     f" {human_bytes(b)}" for b, label, m, s in big[:5])
    coupled = ""
    if search.coupled and search.levers.accumulation is None and not search.traced_at_microbatch:
        coupled = (f" Gradient accumulation was left off: batch-coupled ops ({describe_coupled(search.coupled, 2)}) "
                   "would compute something else on parts of the batch; pass accumulation=k to accept that.")
    applied = [f"accumulation={k}"] + [f"{t}: {p.as_keywords()}" for t, p in sorted(levers.blocks.items())]
    return InfeasiblePlanError(
        f"no plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on mesh {mesh.shape}: the "
        f"smallest plan needs {int(need)} bytes ({human_bytes(need)}) per device at its peak, in its "
        f"{sol.memory_peak_phase} (by category: {parts}), with every memory lever "
        f"the pins allow applied ({'; '.join(applied)}). Largest items per device in that plan: {tops}. To relax: "
        f"use more devices (a larger mesh), a larger memory_limit, a lighter optimizer (optimizer='sgd', SGD "
        f"without momentum, keeps no state; 'sgd_momentum' one), a smaller batch, or unpin the memory levers "
        f"({', '.join(chosen_keywords())})."
        + coupled)
