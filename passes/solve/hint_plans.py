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

from dataclasses import replace
from typing import Sequence

from autoshard.passes.sharding.pins import PinError, Pins
from autoshard.passes.solve.ilp import solve
from autoshard.passes.solve.problem import ShardingProblem
from autoshard.passes.solve.strategy_graph import StrategyGraph

__all__ = ["pinned_choices"]


def _restricted(problem: ShardingProblem, graph: StrategyGraph, pins: Pins):
    """``graph`` with each cluster node limited to what ``pins`` allow every member, or None when the pins
    do not hold here (a ``PinError``) or leave some cluster nothing."""
    try:
        allowed = Pins(params=pins.params, inputs=pins.inputs, ops=pins.ops).resolve(problem.captured, problem.table,
                                                                                     problem.mesh)
    except PinError:
        return None
    members = problem.clustering.members
    if len(graph.nodes) != len(members) + 1:  # the program's outputs are the graph's last node
        raise AssertionError(f"{len(graph.nodes)} ILP nodes for {len(members)} clusters: not this problem's graph")
    nodes = []
    for node, names in zip(graph.nodes, members):
        keep = set(node.choices())
        for name in names:
            if name in allowed:
                keep &= set(allowed[name])
        if not keep:
            return None
        nodes.append(node if len(keep) == len(node.choices()) else replace(node, allowed=sorted(keep)))
    nodes.append(graph.nodes[-1])
    return StrategyGraph(nodes, graph.edges, graph.memory_limit, graph.groups)


def pinned_choices(problem: ShardingProblem, graph: StrategyGraph, hints: Sequence[Pins], *,
                   time_limit_s: float) -> tuple[list[list[int]], float]:
    """For each of ``hints`` that holds on ``problem``, the cheapest choice of ``graph`` (the problem's
    ILP input, priced by the caller's cost model) within its pins and ``graph``'s memory limit; with
    the deterministic work-seconds the solves spent. Each solve is capped at ``time_limit_s``."""
    choices, work = [], 0.0
    for pins in hints:
        sub = _restricted(problem, graph, pins)
        if sub is None:
            continue
        result = solve(sub, time_limit_s=time_limit_s)
        work += float(result.stats.get("work", 0.0))
        if result.choice is not None:
            choices.append(result.choice)
    return choices, work
