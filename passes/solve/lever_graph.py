"""The sharding ILP's problem with memory levers: every op of a repeated-block type chooses its
strategy AND its type's policy, in one solve.

Each ILP node (a cluster of identical layer nodes, ``passes.solve.clustering``) that is an op of a
block type with a policy choice gets the strategies ``(s, r)`` for every strategy ``s`` and every
allowed policy ``r`` of its type (index ``r_position * S + s``), priced by
``passes.solve.lever_costs.LeverPricer``; the type's members form one ``PolicyGroup``, so the ILP
(``passes.solve.ilp``) adds a one-hot ``y[type, r]`` and the linking rows
``sum_s x[i, (s, r)] = y[type, r]``. An edge's placement classes carry the policy on an expanded
side: its price depends on the consumer's policy (re-issued collectives, what is kept), and two
members of one type under different policies never meet (forbidden pairs, no variable). Followers
stay foldable: an edge inside one type maps class ``(p, r)`` to ``(p, r)``.

Parameters, inputs and ops outside numbered blocks keep one copy of their strategies (no policy).
With no block type to expand this is exactly the plain sharding ILP (``planner.build_strategy_graph``).

``LeverGraph.decode(choice)`` turns the ILP's answer into (node -> Strategy, block type -> policy index).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from autoshard.passes.layout.redistribution import encode
from autoshard.passes.solve.clustering import OUTPUT, cluster_edges, graph_edges, output_placements
from autoshard.passes.solve.lever_costs import LeverPricer
from autoshard.passes.solve.strategy_graph import PolicyGroup, SGEdge, SGNode, StrategyGraph
from autoshard.passes.spec import Strategy

__all__ = ["LeverGraph", "build_lever_graph", "node_cost_floor"]


@dataclass
class LeverGraph:
    """The ILP's input and how to read its answer back."""
    graph: StrategyGraph
    members: list[list[str]]  # per ILP node (without the output node): the cluster's nodes
    tables: list[list[Strategy]]  # per ILP node: the representative's strategies
    policies: list[list[Optional[int]]]  # per ILP node: the policy of each expanded position
    types: list[Optional[str]]  # per ILP node: its block type when expanded
    node_index: dict[str, int] = field(default_factory=dict)

    def decode(self, choice: list[int]) -> tuple[dict[str, Strategy], dict[str, int]]:
        """(node -> Strategy, block type -> index into ``lever_costs.policy_space()``) of an ILP choice."""
        chosen: dict[str, Strategy] = {}
        policies: dict[str, int] = {}
        for i, names in enumerate(self.members):
            table = self.tables[i]
            k = choice[i]
            strategy = table[k % len(table)]
            for name in names:
                chosen[name] = strategy
            if self.types[i] is not None:
                policies[self.types[i]] = self.policies[i][k // len(table)]
        return chosen, policies


def _expanded_node(problem, pricer: LeverPricer, allowed_policies: dict[str, list[int]], rep: str):
    """Node ``rep`` expanded by its block type's allowed policies: (block type, policies, seconds, bytes,
    allowed): the prices at index ``r_position * len(strategies) + s`` (``build_lever_graph``'s expanded
    node) and the indices its pins allow (None: all)."""
    btype = pricer.blocks.type_of(rep) if problem.facts.kind[rep] == "op" else None
    rs: list[Optional[int]] = list(allowed_policies[btype]) if btype in allowed_policies else [None]
    strategies = problem.table[rep]
    costs, mems = [], []
    bases: list = [None] * len(strategies)  # a strategy's cost-model price is the same under every policy
    for r in rs:
        for j, s in enumerate(strategies):
            base, lever = pricer.node(rep, s, r, base=bases[j])
            bases[j] = base
            costs.append(lever.seconds)
            mems.append(base.params + base.grads + base.optimizer + base.held_grads + lever.memory)
    pinned = problem.allowed.get(rep)
    allowed = None if pinned is None else [j * len(strategies) + k for j in range(len(rs)) for k in sorted(pinned)]
    return btype, rs, costs, mems, allowed


def node_cost_floor(problem, pricer: LeverPricer, allowed_policies: dict[str, list[int]]) -> float:
    """The nodes' part of ``ilp.cost_floor`` of ``build_lever_graph(problem, pricer, allowed_policies,
    ...)``'s graph, without pricing an edge: every ILP node at its cheapest allowed strategy, times its
    multiplicity. Edges price collectives and re-issued work, never below 0 seconds, so this is at most
    that graph's ``cost_floor``: a count it already cuts off needs no lever graph (``planner``)."""
    total = 0.0
    for names in problem.clustering.members:
        _, _, costs, _, allowed = _expanded_node(problem, pricer, allowed_policies, names[0])
        finite = [costs[c] for c in (range(len(costs)) if allowed is None else allowed) if math.isfinite(costs[c])]
        if finite:
            total += len(names) * min(finite)
    return total


def build_lever_graph(problem, pricer: LeverPricer, allowed_policies: dict[str, list[int]],
                      memory_limit: Optional[float]) -> LeverGraph:
    """The ILP's input for ``problem`` (a ``planner.ShardingProblem``), with the ops of every block
    type in ``allowed_policies`` expanded by its allowed policies (see the module docstring)."""
    table, cm = problem.table, pricer.cm
    nodes: list[SGNode] = []
    members, tables, node_policies, node_types = [], [], [], []
    for names in problem.clustering.members:
        rep = names[0]
        btype, rs, costs, mems, allowed = _expanded_node(problem, pricer, allowed_policies, rep)
        nodes.append(SGNode(rep, costs, mems, len(names), allowed))
        members.append(list(names))
        tables.append(list(table[rep]))
        node_policies.append(rs)
        node_types.append(btype if rs != [None] else None)
    out_index = len(nodes)
    nodes.append(SGNode(OUTPUT, [0.0], [0.0]))
    out_placements = output_placements(problem.captured, cm.mesh.ndim)
    out_codes = encode(out_placements) if out_placements is not None else None
    codes: dict = {}

    def classes(name: str, side: str, k: int) -> tuple[list[int], list[tuple]]:
        key = (name, side, k)
        if key not in codes:
            index: dict = {}
            cls = [index.setdefault(encode(getattr(s, side)[k]), len(index)) for s in table[name]]
            codes[key] = (cls, list(index))
        return codes[key]

    edges: list[SGEdge] = []
    for (cu, slot, cv, i), (mult, (u, _, v, _)) in cluster_edges(graph_edges(problem.captured),
                                                                problem.clustering).items():
        if cv == OUTPUT and out_codes is None:
            continue  # a pipeline stage's outputs leave as placed: nothing moves
        u_cls, srcs = classes(u, "outputs", slot)
        ru = node_policies[cu]
        if cv == OUTPUT:
            v_cls, dsts, rv, vi = [0], [out_codes], [None], out_index
        else:
            (v_cls, dsts), rv, vi = classes(v, "inputs", i), node_policies[cv], cv
        same_group = cv != OUTPUT and node_types[cu] is not None and node_types[cu] == node_types[cv]
        cost = [[0.0] * (len(dsts) * len(rv)) for _ in range(len(srcs) * len(ru))]
        mem = [[0.0] * (len(dsts) * len(rv)) for _ in range(len(srcs) * len(ru))]
        prices = pricer.edge_table(u, slot, OUTPUT if cv == OUTPUT else v, i, srcs, dsts, rv)
        for b in range(len(rv)):
            for q in range(len(dsts)):
                col = b * len(dsts) + q
                for p in range(len(srcs)):
                    seconds, memory = prices[b][q][p]
                    for a in range(len(ru)):
                        row = a * len(srcs) + p
                        if same_group and a != b:
                            cost[row][col] = math.inf
                        else:
                            cost[row][col] = seconds
                            mem[row][col] = memory
        u_class = [a * len(srcs) + c for a in range(len(ru)) for c in u_cls]
        v_class = [b * len(dsts) + c for b in range(len(rv)) for c in v_cls]
        same = {d: q for q, d in enumerate(dsts)}
        if len(rv) > 1 and not same_group:
            follow = None  # the consumer's policy is not its producer's: not a follower
        else:
            follow = [(a * len(dsts) if len(rv) > 1 else 0) + same[p] if p in same else -1
                      for a in range(len(ru)) for p in srcs]
        edges.append(SGEdge(cu, vi, u_class, v_class, cost, mem, mult, follow))
    groups: dict[str, PolicyGroup] = {}
    for i, btype in enumerate(node_types):
        if btype is None:
            continue
        group = groups.setdefault(btype, PolicyGroup(btype, len(node_policies[i])))
        group.members[i] = [j for j in range(len(node_policies[i])) for _ in tables[i]]
    graph = StrategyGraph(nodes, edges, memory_limit, list(groups.values()))
    return LeverGraph(graph, members, tables, node_policies, node_types,
                      {name: i for i, names in enumerate(members) for name in names})
