"""The strategy-selection ILP, solved with OR-tools CP-SAT. Knows nothing about torch.

Input: a ``StrategyGraph`` (``passes/solve/strategy_graph.py``): nodes ``i`` with strategies ``s``, each with a cost ``C[i,s]`` (seconds)
and a memory ``M[i,s]`` (bytes); edges ``(u, v)`` whose cost depends on the producer's output
placement class ``p = cls_u(s_u)`` and the consumer's operand placement class ``q = cls_v(s_v)``:
``c_e[p,q]`` seconds and ``w_e[p,q]`` bytes; multiplicities ``m_i``, ``m_e`` (how many identical
layer instances a cluster node / edge stands for); a memory limit ``L`` (bytes per device).

    variables   x[i,s] in {0,1}          node i runs strategy s
                e[p,q] in {0,1}          per edge: producer class p meets consumer class q
    (1) one strategy per node            sum_s x[i,s] = 1
    (2) edge consistency                 sum_q e[p,q] = sum_{s: cls_u(s)=p} x[u,s]      for every p
        (transportation form)            sum_p e[p,q] = sum_{s: cls_v(s)=q} x[v,s]      for every q
    (3) memory                           sum_i m_i sum_s M[i,s] x[i,s] + sum_e m_e sum_pq w_e[p,q] e[p,q] <= L
    (4) pins                             x[i,s] = 0 for every s not allowed at node i
    (5) policy groups                    sum_r y[g,r] = 1;  sum_{s: pol_i(s)=r} x[i,s] = y[g,r]
                                         for every member i of group g and policy r
    (6) a cost cap (optional)            the objective's terms of chosen nodes and edges <= B
    objective   minimize  sum_i m_i sum_s C[i,s] x[i,s] + sum_e m_e sum_pq c_e[p,q] e[p,q]

A pair (p, q) of infinite cost is forbidden: it gets no variable (its row and column sums still
balance, since only allowed pairs carry the class indicators), and a strategy that folding leaves
with an infinite cost is excluded like a pinned-out one. ``y[g,r]`` (one-hot) is the policy of
group ``g`` (``passes.solve.strategy_graph.PolicyGroup``): every member takes a strategy of it.

With exactly one x per node, (2) makes e the indicator of the single (p, q) pair in use, so the
linearization is exact while using |P| x |Q| edge variables instead of |S_u| x |S_v|. An edge whose
producer (or consumer) side can only be in one class costs a function of the other side alone, and
an edge from a node to itself (a cluster feeding its own next instance) a function of that node's
strategy; both are folded into C and M without edge variables. CP-SAT needs integer coefficients:
costs are scaled so the largest possible total is about 1e9 units, bytes by ``L / 1e9``.

>>> from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph
>>> g = StrategyGraph([SGNode("a", [1.0, 0.5], [0, 0]), SGNode("b", [1.0, 0.5], [0, 0])],
...                   [SGEdge(0, 1, [0, 1], [0, 1], [[0.0, 3.0], [3.0, 0.0]])])
>>> solve(g).choice
[1, 1]
"""
from __future__ import annotations

import math
import time
from itertools import chain
from typing import Optional, Sequence

import numpy as np

from autoshard.passes.solve.ilp_model import CPSAT_SEED, ILPResult, ShardingILP
from autoshard.passes.solve.memory_search import cutoff_units, hint_objective, lagrangian_hint, reduced_cost_fixings
from autoshard.passes.solve.strategy_graph import StrategyGraph, greedy, merge_followers

__all__ = ["ILPResult", "ShardingILP", "solve", "lp_bound", "cost_floor", "memory_floor", "CPSAT_SEED",
           "CAP_PROBE_WORK"]

#: the work (CP-SAT deterministic seconds) a memory-bound search of a solve given a ``cap`` gets before
#: the cap joins the ILP: the searches that end sooner (most) answer as without a cap; a tiny GPT's
#: published layout took 2.5 work-s to prove an optimum whose exposed floor the cap excludes
CAP_PROBE_WORK = 0.05


def _floors(graph: StrategyGraph) -> tuple[float, float]:
    """Lower bounds on cost and memory that need no solver: every node and edge at its cheapest (an
    edge's memory at its smallest among the class pairs of finite cost)."""
    cost = memory = 0.0
    options = [[s for s in n.choices() if math.isfinite(n.cost[s])] for n in graph.nodes]
    for n, ss in zip(graph.nodes, options):
        if ss:
            cost += n.multiplicity * min(n.cost[s] for s in ss)
            memory += n.multiplicity * min(n.memory[s] for s in ss)
    for e in graph.edges:
        ps = sorted({e.u_class[s] for s in options[e.u]})
        qs = sorted({e.v_class[s] for s in options[e.v]})
        if not ps or not qs:
            continue
        # the (p, q) block of the matrix read flat in C and reduced by numpy: a tiny Llama's edges hold up to
        # 35 x 35 pairs, and a Python loop over them (then numpy on nested lists) was most of a
        # memory-bound solve's floors
        prices = _block(e.cost, ps, qs)
        finite = np.isfinite(prices)
        if not finite.any():
            continue
        cost += e.multiplicity * float(prices[finite].min())
        if e.memory is not None:
            memory += e.multiplicity * float(_block(e.memory, ps, qs)[finite].min())
    return cost, memory


def _block(matrix: list[list[float]], ps: list[int], qs: list[int]) -> np.ndarray:
    """Rows ``ps``, columns ``qs`` (sorted, distinct) of ``matrix``, as a float array."""
    whole = _as_array(matrix)
    if len(ps) == whole.shape[0] and len(qs) == whole.shape[1]:
        return whole
    return whole[np.ix_(ps, qs)]


#: ``_as_array``'s arrays by the id of the matrix read (kept with it, so the id is not reused while cached),
#: and how many values they hold together; emptied past ``_CACHED_VALUES``
_ARRAYS: dict[int, tuple[list, np.ndarray]] = {}
_CACHED = [0]
_CACHED_VALUES = 4_000_000


def _as_array(matrix: list[list[float]]) -> np.ndarray:
    """``matrix`` (an edge's prices: never changed once its edge is built, ``strategy_graph.SGEdge``) as a
    float array, made once per matrix: the graphs a search solves (policies fixed, layouts sliced, followers
    folded) share their edges' matrices, and reading them again per solve was most of a tiny Llama's
    memory-bound floors (its graph of every policy holds 470 K prices)."""
    hit = _ARRAYS.get(id(matrix))
    if hit is not None and hit[0] is matrix:
        return hit[1]
    rows, cols = len(matrix), len(matrix[0])
    array = np.fromiter(chain.from_iterable(matrix), dtype=float, count=rows * cols).reshape(rows, cols)
    if _CACHED[0] + array.size > _CACHED_VALUES:
        _ARRAYS.clear()
        _CACHED[0] = 0
    _ARRAYS[id(matrix)] = (matrix, array)
    _CACHED[0] += array.size
    return array


def cost_floor(graph: StrategyGraph) -> float:
    """A lower bound on the cost of every choice of ``graph``, memory ignored, that needs no solver:
    every node and edge at its cheapest (``solve`` answers "CUTOFF" from it)."""
    return _floors(graph)[0]


def memory_floor(graph: StrategyGraph) -> float:
    """A lower bound on the memory of every answer ``solve(graph)`` can give, whatever its objective and
    limit, that needs no solver: the followers folded as ``solve`` folds them, then every node and edge
    at its smallest. ``solve`` answers "INFEASIBLE" without a search when it exceeds the limit."""
    return _floors(merge_followers(graph)[0])[1]


def lp_bound(graph: StrategyGraph) -> Optional[float]:
    """A lower bound on the cost of ``graph``'s best choice IGNORING its memory limit: the LP
    relaxation's optimum (followers folded), or None when GLOP fails."""
    reduced, _ = merge_followers(StrategyGraph(graph.nodes, graph.edges, None, graph.groups))
    ilp = ShardingILP(reduced)
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    ilp.add_policy_groups()
    ilp.add_pins()
    ilp.set_objective("cost")
    status, _, bound, _ = ilp.lp_relaxation()
    return bound / ilp.scale if status == "OPTIMAL" and bound is not None else None


def solve(graph: StrategyGraph, *, objective: str = "cost", time_limit_s: float = 30.0, workers: int = 2,
          merge: bool = True, cutoff: Optional[float] = None, hints: Sequence[list[int]] = (),
          kept: Optional[dict] = None, cap: Optional[tuple[set, set, float]] = None,
          capped_now: bool = False) -> ILPResult:
    """Minimize ``objective`` ("cost" under the memory limit, or "memory") over ``graph``.

    Steps: fold followers (``merge_followers``, unless ``merge=False``); solve the LP relaxation
    with GLOP; give CP-SAT the LP bound and a warm start (the rounded LP optimum, else a greedy
    assignment). When the LP optimum is integral CP-SAT only confirms it. When it is fractional because
    the memory row binds, the warm start is the Lagrangian plan if cheaper, variables that no plan as
    good as it can use are fixed to 0 and CP-SAT runs one sequential search instead of its portfolio
    (``passes/solve/memory_search.py``; ``stats["memory_search"]``, ``stats["fixed_by_reduced_cost"]``,
    ``stats["lagrangian_warm_start"]`` when the Lagrangian plan is the warm start). Status "INFEASIBLE"
    (choice None) when nothing fits the limit; "GREEDY" when CP-SAT found nothing in time but the
    greedy assignment fits. ``cutoff``: a known solution's objective (seconds or bytes); when the LP
    bound shows nothing here beats it, status "CUTOFF" (choice None, ``cost`` the bound) without
    running CP-SAT; ``stats["memory_binding"]`` then says whether the memory limit shaped that bound
    (when it did not, the bound holds for the problem without the limit too).

    ``time_limit_s`` is a WORK limit, CP-SAT deterministic seconds (about wall seconds on a quiet
    core), never a clock: the answer does not depend on the machine's load. ``stats["work"]``: the
    deterministic seconds spent; ``stats["lower_bound"]``: the best proven lower bound on the
    objective (seconds or bytes), from the LP relaxation or CP-SAT, whichever is higher.

    ``kept``: a dict the caller keeps between solves of one ``graph`` whose memory limit it lowers (the
    planner's peak retries): the first solve leaves its ILP there, later ones change only the memory
    row's bound (in the units the row was built in), and their LPs start from the last optimal basis
    (``ShardingILP.solve_lp``). ``kept["donor"]``: an ILP done with (another policy combination's of the
    same lever graph) whose GLOP solver the first solve's ILP takes over when their rows match
    (``ShardingILP.adopt_lp``; ``stats["lp_adopted"]``), so its first LP restarts from that basis too.

    ``hints``: known choices of ``graph`` (one strategy index per node, e.g. a published layout's plan
    on this problem). The cheapest one that fits becomes CP-SAT's warm start when it beats the solver's
    own, and the answer is never worse than it: when CP-SAT stops at something costlier (or at
    nothing), that hint is the answer (``stats["hint_kept"]``). So a problem never prices above a plan
    it was shown.

    ``cap``: (nodes, edges, seconds), for a caller that wants nothing whose cost counted over those nodes
    and edges (indices into ``graph.nodes`` / ``graph.edges``) exceeds ``seconds``. The answer is the one
    without ``cap`` (the caller checks it) unless the memory-bound search (``memory_search``) does not
    end within ``CAP_PROBE_WORK``: the ILP is then built again with the cap as a second budget row
    (``ShardingILP.add_cost_cap``; followers not folded, since the indices name ``graph``'s own) and the
    answer is the cheapest choice within it (``stats["capped"]``; ``stats["work"]`` counts both
    searches). The sequential search is deterministic, so one that ends within the probe answers as
    it would have with the whole limit. ``capped_now``: the cap is a row from the start.
    """
    again = kept is not None and kept.get("graph") is graph and objective == "cost" and graph.memory_limit
    again = again and (not capped_now or kept["model"][2].capped)
    if again:  # the same graph, its memory limit lowered: the ILP and its LP solver are kept
        reduced, expand, ilp, (cost_floor, memory_floor) = kept["model"]
        reduced.memory_limit = graph.memory_limit
    else:
        reduced, expand = merge_followers(graph) if merge and not capped_now else (graph, list)
        cost_floor, memory_floor = _floors(reduced)
    t0 = time.perf_counter()
    if objective == "cost" and reduced.memory_limit is not None and memory_floor > reduced.memory_limit:
        return ILPResult(None, math.inf, math.inf, "INFEASIBLE", time.perf_counter() - t0, 0, 0,
                         {"memory_floor": memory_floor})
    if objective == "cost" and cutoff is not None and cost_floor >= cutoff * (1 - 1e-6):
        return ILPResult(None, cost_floor, math.inf, "CUTOFF", time.perf_counter() - t0, 0, 0,
                         {"memory_binding": False})
    if again:
        ilp.set_memory_limit(graph.memory_limit)
    else:
        ilp = _model(reduced, objective, cap if capped_now else None)
        ilp.solved_again = kept is not None and objective == "cost"
        if kept is not None and objective == "cost" and ilp.memory_row is not None:
            donor = kept.pop("donor", None)
            if donor is not None:
                ilp.adopt_lp(donor)
            kept.update(graph=graph, model=(reduced, expand, ilp, (cost_floor, memory_floor)))

    def fits(choice):  # (an inconsistent choice evaluates to infinity)
        cost, mem = reduced.evaluate(choice)
        return math.isfinite(cost) and (limit is None or mem <= limit)

    t0 = time.perf_counter()
    lp_status, rounded, bound, integral = ilp.lp_relaxation()
    limit = reduced.memory_limit if objective == "cost" else None
    lp_s = time.perf_counter() - t0
    stats = dict(ilp_nodes=len(reduced.nodes), merged_followers=len(graph.nodes) - len(reduced.nodes),
                 lp_s=round(lp_s, 4), lp_integral=integral, **({"capped": True} if ilp.capped else {}),
                 **({"lp_adopted": True} if ilp.lp_adopted and not again else {}))
    if lp_status == "INFEASIBLE":  # the relaxation has no point under the limit: neither has the ILP
        return ILPResult(None, math.inf, math.inf, "INFEASIBLE", lp_s, ilp.num_vars, len(ilp.rows), stats)
    if cutoff is not None and bound is not None and bound / ilp.scale >= cutoff * (1 - 1e-6):
        stats["memory_binding"] = ilp.memory_binding is not False
        return ILPResult(None, bound / ilp.scale, math.inf, "CUTOFF", lp_s, ilp.num_vars, len(ilp.rows), stats)
    hint = greedy(reduced, objective)
    if not fits(hint):
        hint = greedy(reduced, "memory")
    if rounded is not None and fits(rounded):
        hint = rounded
    if not isinstance(hints, (list, tuple)):  # ``hint_plans.LazyHints``: solved only if they can matter
        hints, time_limit_s = _lazy_hints(hints, graph, reduced, ilp, expand, rounded, bound, integral, fits,
                                          time_limit_s)
    shown = _best_hint(graph, hints, limit, objective)
    if shown is not None:
        index = {n.name: i for i, n in enumerate(graph.nodes)}
        mine = [shown[index[n.name]] for n in reduced.nodes]
        if fits(mine) and (not fits(hint) or _value(reduced, mine, objective) < _value(reduced, hint, objective)):
            hint = mine
    fixed, upper, binding = frozenset(), None, limit is not None and not integral and bool(ilp.memory_binding)
    if binding:  # a fractional optimum shaped by the memory row: passes/solve/memory_search.py
        upper = None if cutoff is None else cutoff_units(ilp, cutoff)
        # priced under a cutoff too unless the warm start already beats it: the cutoff is the best plan
        # of another policy or microstep count, and can lie far above this one's optimum (a tiny Llama's
        # second policy: cutoff 14 % above, 5.7 K variables fixed and 3.8 work-s of search; its
        # Lagrangian plan was optimal, 28 K fixed, 0.002 work-s)
        if upper is None or not fits(hint) or hint_objective(ilp, hint) > upper:
            priced = lagrangian_hint(ilp, fits)
            if priced is not None and (not fits(hint) or reduced.evaluate(priced)[0] < reduced.evaluate(hint)[0]):
                hint = priced
                stats["lagrangian_warm_start"] = True
        if bound is not None:
            fixed = reduced_cost_fixings(ilp, bound, hint if fits(hint) else None, upper)
        stats.update(memory_search=True, fixed_by_reduced_cost=len(fixed))
    probe = cap is not None and binding and not ilp.capped and objective == "cost"
    result = _confirmed(ilp, hint, rounded, bound, integral, binding)  # None whenever binding, so never probed
    if result is None:
        work = min(CAP_PROBE_WORK, max(0.1, time_limit_s)) if probe else max(0.1, time_limit_s)
        result = ilp.solve_cpsat(work, workers, hint, bound, fixed_zero=fixed, portfolio=not binding, upper_bound=upper)
    if probe and result.status not in ("OPTIMAL", "INFEASIBLE"):  # a long search ahead: within the cap
        spent = float(result.stats.get("work", 0.0))
        capped = solve(graph, objective=objective, time_limit_s=max(0.1, time_limit_s - spent), workers=workers,
                       merge=merge, cutoff=cutoff, hints=hints, kept=kept, cap=cap, capped_now=True)
        capped.stats["work"] = float(capped.stats.get("work", 0.0)) + spent
        capped.stats["uncapped_probe"] = result.status
        return capped
    if upper is not None and result.status == "INFEASIBLE":  # nothing here beats the cutoff
        result.status, result.cost = "CUTOFF", cutoff
        result.stats["memory_binding"] = True  # so no multiple of k is pruned on its account
    result.wall_s += lp_s
    result.stats.update(stats)
    bounds = [b / ilp.scale for b in (bound, result.stats.get("bound")) if b is not None]
    if bounds:
        result.stats["lower_bound"] = max(bounds)
    choice = result.choice
    if choice is None and result.status == "UNKNOWN" and fits(hint):
        choice, result.status = hint, "GREEDY"
    if choice is not None:
        result.choice = expand(choice)
        result.cost, result.memory = graph.evaluate(result.choice)
    if shown is not None and result.status != "CUTOFF" and (
            result.choice is None or _value(graph, shown, objective) < _value(graph, result.choice, objective)):
        result.choice = list(shown)
        result.cost, result.memory = graph.evaluate(result.choice)
        result.status = "FEASIBLE" if result.status in ("OPTIMAL", "UNKNOWN", "GREEDY", "INFEASIBLE") else result.status
        result.stats["hint_kept"] = True
    return result


def _lazy_hints(lazy, graph: StrategyGraph, reduced: StrategyGraph, ilp: ShardingILP, expand, rounded, bound,
                integral: bool, fits, time_limit_s: float) -> tuple[Sequence[list[int]], float]:
    """``lazy``'s hints and the work limit left after them, or none when they cannot change the answer:
    the LP optimum ``rounded`` is integral, fits, is what ``_confirmed`` returns without CP-SAT, and every
    hint costs more (``_hints_bound``), so none is the warm start or replaces the answer."""
    if rounded is not None and fits(rounded) and _confirmed(ilp, rounded, rounded, bound, integral, False) is not None:
        # a hint beats ``rounded`` only if its integer objective is within one unit per term of it (each
        # term rounded by half a unit, in both), beyond GLOP's tolerance on the bound
        slack = len(ilp.x) + len(ilp.edge_terms) + 1e-6 * abs(bound) + 1
        if _hints_bound(ilp, graph, reduced, rounded, bound, lazy.kept()) > hint_objective(ilp, rounded) + slack:
            return (), time_limit_s
    return lazy.load()


def _hints_bound(ilp: ShardingILP, graph: StrategyGraph, reduced: StrategyGraph, rounded: list[int], bound: float,
                 kept: list[list[list[int]]]) -> float:
    """A lower bound (objective units) on every choice of ``graph`` within one of the strategy sets ``kept``
    (per layout, per node of ``graph``) that fits the memory row, from the integral LP optimum ``rounded``
    of value ``bound`` and its reduced costs d: a feasible x costs at least ``bound + d.(x - x*)`` (the
    equality rows cancel, the memory row's dual only adds), and x* is 0/1, so moving node i from
    ``rounded[i]`` to s adds d[i, s] - d[i, rounded[i]] >= 0 and every other term is >= 0 too."""
    costs = getattr(ilp, "lp_reduced_costs", None)
    if not costs:
        return -math.inf
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    where = [index[n.name] for n in reduced.nodes]
    least = math.inf
    for sets in kept:
        total = 0.0
        for i, xs in enumerate(ilp.x):
            keep = sets[where[i]]
            r = rounded[i]
            if r in keep:
                continue
            options = [costs[xs[s]] for s in keep if s in ilp.allowed[i]]
            if not options:  # no finite-cost choice here: this layout has no plan to show
                total = math.inf
                break
            total += min(options) - costs[xs[r]]
        for e, evars in ilp.edge_terms if math.isfinite(total) else ():  # one pair of classes per edge, likewise
            ps = {e.u_class[s] for s in sets[where[e.u]] if s in ilp.allowed[e.u]}
            qs = {e.v_class[s] for s in sets[where[e.v]] if s in ilp.allowed[e.v]}
            now = evars.get((e.u_class[rounded[e.u]], e.v_class[rounded[e.v]]))
            if now is None or (e.u_class[rounded[e.u]] in ps and e.v_class[rounded[e.v]] in qs):
                continue
            options = [costs[k] for (p, q), k in evars.items() if p in ps and q in qs]
            if options:
                total += min(options) - costs[now]
        least = min(least, total)
    return bound + least


def _model(graph: StrategyGraph, objective: str, cap: Optional[tuple[set, set, float]] = None) -> ShardingILP:
    """The ILP of ``graph`` minimising ``objective`` (its memory row only for "cost"), with ``cap``'s row."""
    ilp = ShardingILP(graph)
    ilp.add_one_strategy_per_node()
    ilp.add_edge_consistency()
    ilp.add_policy_groups()
    if objective == "cost":
        ilp.add_memory_constraint()
    ilp.add_pins()
    ilp.set_objective(objective)
    if cap is not None:
        ilp.add_cost_cap(*cap)
    return ilp


#: CP-SAT's ``relative_gap_limit`` (``ShardingILP.solve_cpsat``)
_GAP = 1e-5


def _confirmed(ilp: ShardingILP, hint: list[int], rounded: Optional[list[int]], bound: Optional[float],
               integral: bool, binding: bool) -> Optional[ILPResult]:
    """The answer CP-SAT gives without searching, or None when it would search: the LP optimum is
    integral, its memory row (if any) does not bind, and it is CP-SAT's warm start, so the warm start is
    optimal; when its objective is within CP-SAT's relative gap of the lower bound CP-SAT is handed
    (``solve_cpsat``'s, from the LP bound), CP-SAT stops at that first solution, spending no work
    (measured: deterministic time 0.0 on the 405B's candidates), and returns it. When the warm start's
    objective equals the LP bound but one objective unit exceeds that gap, CP-SAT searched (its limit,
    or until it proved the same start optimal) to return that start: it is returned without the search. Building its model
    (a bulk proto of ~30 K variables) and loading it cost a 405B candidate's solve about as much as the
    LP itself; the choice, status and work charged are the same as CP-SAT's."""
    if not integral or binding or rounded is None or hint is not rounded or bound is None:
        return None
    objective = hint_objective(ilp, hint)
    lo = math.floor(bound - 1e-6 * abs(bound) - 1)  # as solve_cpsat loosens the LP bound
    # the warm start IS the LP optimum (integral), so no choice is cheaper: optimal whatever the scale. CP-SAT,
    # handed the loosened bound, could not see that when one objective unit is above its relative gap (an
    # objective of ~1e5 units: the memory objective's least-memory plans, an unlimited cost solve) and
    # searched up to its whole limit to return this same start (Llama 3 405B: 4 such solves, 12 CPU s)
    attained = objective <= bound + 1e-9 * max(1.0, abs(bound))
    if not attained and objective - lo > 0.99 * _GAP * max(1.0, abs(objective)):  # a hair inside: whichever side CP-SAT divides by
        return None
    cost, memory = ilp.g.evaluate(hint)
    return ILPResult(list(hint), cost, memory, "OPTIMAL", 0.0, ilp.num_vars, len(ilp.rows),
                     {"objective": float(objective), "bound": float(lo), "work": 0.0, "confirmed_by_lp": True})


def _value(graph: StrategyGraph, choice: list[int], objective: str) -> float:
    cost, memory = graph.evaluate(choice)
    return cost if objective == "cost" else memory


def _best_hint(graph: StrategyGraph, hints: Sequence[list[int]], limit: Optional[float],
               objective: str) -> Optional[list[int]]:
    """The cheapest of ``hints`` (choices of ``graph``) that is consistent and fits ``limit``, else None."""
    best, value = None, math.inf
    for h in hints:
        if len(h) != len(graph.nodes) or any(s not in graph.nodes[i].choices() for i, s in enumerate(h)):
            continue
        cost, memory = graph.evaluate(h)
        if not math.isfinite(cost) or (limit is not None and memory > limit):
            continue
        v = cost if objective == "cost" else memory
        if v < value:
            best, value = list(h), v
    return best
