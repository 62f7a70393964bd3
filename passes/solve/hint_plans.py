"""Known plans as solver hints: the best plan a set of pins allows, as a choice of the free problem's ILP.

A candidate of the stage planner (one pipeline depth and submesh) is solved without pins, with a
short work limit; a published layout of the same shape (Megatron's or FSDP's placements on that
submesh) is one of the plans it can choose. ``pinned_choices`` prices each such layout on the same
strategy graph: every ILP node keeps only the strategies the layout's pins allow (intersected over
the members of its cluster), and that much smaller problem is solved. The answers are choices of the
free graph, so ``ilp.solve(graph, hints=...)`` can start from them and never return anything costlier:
a candidate is then never worse, under the ILP's own objective, than the layout it contains.

Only the pins' ``params``, ``inputs`` and ``ops`` are used: ``strategies`` pins may add strategies the
free problem's table does not have, which no choice of its graph can name.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from autoshard.passes.sharding.pins import PinError, Pins
from autoshard.passes.solve.ilp import solve
from autoshard.passes.solve.problem import ShardingProblem
from autoshard.passes.solve.strategy_graph import PolicyGroup, SGEdge, SGNode, StrategyGraph

__all__ = ["pinned_choices", "slice_graph", "LazyHints"]


def _kept(problem: ShardingProblem, graph: StrategyGraph, pins: Pins) -> Optional[list[list[int]]]:
    """Per node of ``graph``, the strategies ``pins`` allow every member of its cluster (within what the
    node already allows), or None when the pins do not hold here (a ``PinError``) or leave some
    cluster nothing."""
    try:
        allowed = Pins(params=pins.params, inputs=pins.inputs, ops=pins.ops).resolve(problem.captured, problem.table,
                                                                                     problem.mesh)
    except PinError:
        return None
    members = problem.clustering.members
    if len(graph.nodes) != len(members) + 1:  # the program's outputs are the graph's last node
        raise AssertionError(f"{len(graph.nodes)} ILP nodes for {len(members)} clusters: not this problem's graph")
    kept = []
    for node, names in zip(graph.nodes, members):
        keep = set(node.choices())
        for name in names:
            if name in allowed:
                keep &= set(allowed[name])
        if not keep:
            return None
        kept.append(sorted(keep))
    kept.append(graph.nodes[-1].choices())
    return kept


def slice_graph(graph: StrategyGraph, kept: list[list[int]]) -> StrategyGraph:
    """``graph`` with node i holding only its strategies ``kept[i]`` (prices sliced, never recomputed):
    the same problem as ``graph`` with those pins, its choice j at node i being ``kept[i][j]``. Built
    smaller rather than pinned: a pinned node keeps a variable per strategy and is never folded into
    its producer (``merge_followers``), while a node left one strategy here is folded into its
    neighbours' prices (``ShardingILP``), so a layout's mostly fixed problem solves in a fraction of
    the free one's work."""
    nodes = [SGNode(n.name, [n.cost[s] for s in keep], [n.memory[s] for s in keep], n.multiplicity)
             for n, keep in zip(graph.nodes, kept)]
    edges = [SGEdge(e.u, e.v, [e.u_class[s] for s in kept[e.u]], [e.v_class[s] for s in kept[e.v]], e.cost, e.memory,
                    e.multiplicity, e.follow) for e in graph.edges]
    groups = [PolicyGroup(g.name, g.num_policies, {i: [pol[s] for s in kept[i]] for i, pol in g.members.items()})
              for g in graph.groups]
    return StrategyGraph(nodes, edges, graph.memory_limit, groups)


def pinned_choices(problem: ShardingProblem, graph: StrategyGraph, hints: Sequence[Pins], *,
                   time_limit_s: float) -> tuple[list[list[int]], float]:
    """For each of ``hints`` that holds on ``problem``, the cheapest choice of ``graph`` (the problem's
    ILP input, priced by the caller's cost model) within its pins and ``graph``'s memory limit; with
    the deterministic work-seconds the solves spent. Each solve is capped at ``time_limit_s``."""
    choices, work = [], 0.0
    for pins in hints:
        kept = _kept(problem, graph, pins)
        if kept is None:
            continue
        result = solve(slice_graph(graph, kept), time_limit_s=time_limit_s)
        work += float(result.stats.get("work", 0.0))
        if result.choice is not None:
            choices.append([keep[j] for keep, j in zip(kept, result.choice)])
    return choices, work


class LazyHints:
    """Known plans' choices for ``ilp.solve(graph, hints=LazyHints(...))``, priced only when they can matter.

    ``ilp.solve`` reads ``kept()`` first: per layout that holds here, the strategies its pins leave each
    node of ``graph`` (``_kept``, no solver). When the LP relaxation's optimum is integral and confirmed
    without CP-SAT, its reduced costs bound what every choice within those strategies can cost
    (``ilp._hints_bound``); when that bound proves each layout's best costlier than the LP optimum, no
    hint can be the warm start or the answer, and none is solved (Llama 3 405B's pipeline candidates: 12
    of them, 3 layouts each). Otherwise ``load()`` solves them (``solve_hints()``: the choices and the
    work they spent, which ``charge`` takes off the caller's budget before ``limit()`` gives the solve's
    own work limit): the same choices, work and answer as solving them before the call. (A hint not
    solved spends no work: the caller's later solves may get what it would have spent.)"""

    def __init__(self, problem, graph: StrategyGraph, hints: Sequence[Pins], solve_hints: Callable,
                 charge: Callable[[float], None], limit: Callable[[], float]):
        self.problem, self.graph, self.hints = problem, graph, hints
        self.solve_hints, self.charge, self.limit = solve_hints, charge, limit
        self.loaded: Optional[list[list[int]]] = None

    def kept(self) -> list[list[list[int]]]:
        """Per layout that holds on the problem, the strategies it leaves each node of ``graph``."""
        return [kept for kept in (_kept(self.problem, self.graph, pins) for pins in self.hints) if kept is not None]

    def load(self) -> tuple[list[list[int]], float]:
        """(the hints' choices, the solve's work limit once their work is charged)."""
        if self.loaded is None:
            self.loaded, work = self.solve_hints()
            self.charge(work)
        return self.loaded, self.limit()
