"""The sharding problem of one program on one mesh, as the ILP sees it.

A ``ShardingProblem`` (``build_problem``) holds the strategy table, the pinned choices, the
clusters of identical layer nodes and the graph facts. It turns a cost model into the ILP's
``StrategyGraph`` (``build_strategy_graph``) and the ILP's answer into a priced ``Solution``.
The planner (``passes.solve.planner``) builds one per microstep count it tries; the stage planner
prices the same problem per microbatch (``passes.pipeline.stages.candidate_plan.plan_submesh``):

>>> problem = build_problem(captured, (2, 2), hardware=PRESETS["h100"])              # doctest: +SKIP
>>> result = solve(problem.strategy_graph(CostModel(problem.mesh, problem.hardware, "adamw"), 80e9))
>>> problem.solution(result.choice, optimizer="adamw").estimated_step_time           # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Collection, Optional, Union

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import PRESETS, Hardware
from autoshard.passes.solve.context import DEFAULT_HARDWARE, PlanContext
from autoshard.passes.cost.model import CostModel
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.layout.redistribution import R_CODE, encode
from autoshard.passes.levers import Levers
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.aliased_state_writes import narrow_for_aliased_writes
from autoshard.passes.sharding.pins import Pins, pins_name_zero_forms
from autoshard.passes.sharding.strategies import StrategyTable, enumerate_strategies
from autoshard.passes.solve.clustering import (OUTPUT, Clustering, cluster_edges, cluster_nodes, graph_edges,
                                               output_placements)
from autoshard.passes.solve.solution import Solution, evaluate
from autoshard.passes.solve.strategy_graph import SGEdge, SGNode, StrategyGraph
from autoshard.passes.spec import Strategy
from autoshard.passes.writes import written_operands

__all__ = ["build_strategy_graph", "ShardingProblem", "build_problem", "strategy_choices"]


def _classes(items: list) -> tuple[list[int], list]:
    index: dict = {}
    cls = [index.setdefault(tuple(x), len(index)) for x in items]
    return cls, list(index)


def build_strategy_graph(captured: CapturedGraph, table: StrategyTable, allowed: dict[str, list[int]],
                         clustering: Clustering, cm: CostModel, facts: GraphFacts,
                         memory_limit: Optional[float], edges_from: Optional[StrategyGraph] = None) -> StrategyGraph:
    """One ILP node per cluster (priced by its representative, counted ``len(members)`` times), one
    ILP edge per distinct cluster edge; the program's outputs are a fixed consumer wanting
    ``output_placements`` (a loss ``P``, anything else ``R``; a pipeline stage's sent values want
    nothing: no edge).

    ``edges_from``: a graph of the same problem whose edges ``cm`` prices alike (a cost model that
    differs only in what it counts for nodes, e.g. ``MicrobatchCostModel``'s held activations): its
    edges are copied as they are (multiplicities included) instead of priced again; most of a graph's cost is
    its edges."""
    nodes: list[SGNode] = []
    for members in clustering.members:
        rep = members[0]
        prices = [cm.price_node(rep, s, facts) for s in table[rep]]
        nodes.append(SGNode(rep, [p.seconds for p in prices], [p.memory for p in prices], len(members),
                            allowed.get(rep)))
    out_index = len(nodes)
    nodes.append(SGNode(OUTPUT, [0.0], [0.0]))
    if edges_from is not None:
        if len(edges_from.nodes) != len(nodes):
            raise ValueError(f"edges_from has {len(edges_from.nodes)} nodes, this problem {len(nodes)}: not the "
                             "same problem")
        return StrategyGraph(nodes, [replace(e) for e in edges_from.edges], memory_limit)
    out_placements = output_placements(captured, cm.mesh.ndim)
    out_codes = encode(out_placements) if out_placements is not None else None
    codes: dict = {}

    def placements_of(name: str, side: str, k: int) -> list[tuple]:
        key = (name, side, k)
        if key not in codes:
            codes[key] = [encode(getattr(s, side)[k]) for s in table[name]]
        return codes[key]

    edges: list[SGEdge] = []
    for (cu, slot, cv, i), (mult, (u, _, v, _)) in cluster_edges(graph_edges(captured), clustering).items():
        if cv == OUTPUT and out_codes is None:
            continue  # outputs leave as placed: nothing moves
        u_class, srcs = _classes(placements_of(u, "outputs", slot))
        if cv == OUTPUT:
            v_class, dsts, vi = [0], [out_codes], out_index
        else:
            v_class, dsts = _classes(placements_of(v, "inputs", i))
            vi = cv
        nbytes = facts.tensor_outputs(u)[slot].nbytes
        grad = cv != OUTPUT and facts.value_needs_grad(u, slot)  # an output's gradient seed is free
        keeps = cv == OUTPUT or facts.operand_saved(v, i)  # the consumer keeps its copy for backward
        written = cv != OUTPUT and i in written_operands(facts.nodes[v])  # moved back after the op
        cost, mem = [], []
        for p in srcs:
            row_c, row_m = [], []
            for q in dsts:
                colls, copy = cm.moves(p, q, nbytes, grad)
                if written and p != q:
                    colls = colls + cm.moves(q, p, nbytes, grad)[0]
                row_c.append(sum(c.seconds for c in colls))
                row_m.append(copy if keeps else 0.0)
            cost.append(row_c)
            mem.append(row_m)
        same = {q: k for k, q in enumerate(dsts)}
        edges.append(SGEdge(cu, vi, u_class, v_class, cost, mem, mult, [same.get(p, -1) for p in srcs]))
    return StrategyGraph(nodes, edges, memory_limit)


def strategy_choices(captured: CapturedGraph, mesh, pins, storage_forms: bool = False) -> tuple[Mesh, StrategyTable, dict]:
    """The mesh, every node's strategies and the pinned nodes' allowed indices (``storage_forms``: the
    parameters' ZeRO-1/2 and reduce-once forms too, ``enumerate_strategies``; also when the pins name a
    ZeRO form, as a layout's distributed optimizer does); a parameter or buffer written in place through
    an alias is held whole (``passes.sharding.aliased_state_writes``)."""
    mesh = Mesh.of(mesh)
    table = enumerate_strategies(captured, mesh, storage_forms=storage_forms or pins_name_zero_forms(pins))
    if pins is not None and not isinstance(pins, Pins):
        pins = Pins(**pins)
    allowed = pins.resolve(captured, table, mesh) if pins is not None else {}
    return mesh, table, narrow_for_aliased_writes(captured, table, allowed)


@dataclass
class ShardingProblem:
    """What the sharding ILP is built from, for one captured program on one mesh.

    ``table``: every node's strategies; ``allowed``: node -> the strategy indices its pins (and any
    narrowing) leave, absent for a free node; ``clustering``: nodes that share one decision;
    ``facts``: the graph facts the cost model prices with (shapes, compute, which values need grad).
    The cost model is not part of the problem: one problem may be priced several ways.
    """
    captured: CapturedGraph
    mesh: Mesh
    hardware: Hardware
    table: StrategyTable
    allowed: dict[str, Collection[int]]
    facts: GraphFacts
    clustering: Clustering

    def strategy_graph(self, cost_model: CostModel, memory_limit: Optional[float],
                       edges_from: Optional[StrategyGraph] = None) -> StrategyGraph:
        """The ILP's input, priced by ``cost_model`` under ``memory_limit`` bytes per device
        (``edges_from``: see ``build_strategy_graph``)."""
        return build_strategy_graph(self.captured, self.table, self.allowed, self.clustering, cost_model,
                                    self.facts, memory_limit, edges_from)

    def strategies(self, choice: list[int]) -> dict[str, Strategy]:
        """Node -> strategy for the ILP's ``choice`` (one strategy index per cluster), as chosen."""
        chosen: dict[str, Strategy] = {}
        for cid, members in enumerate(self.clustering.members):
            for name in members:
                chosen[name] = self.table[name][choice[cid]]
        return chosen

    def settle_inputs(self, chosen: dict[str, Strategy]) -> None:
        """An input (or the target) placed R whose consumers all read it one way takes that placement:
        the runtime chunks the global batch for free either way, and the plan then says what each rank
        gets (e.g. the batch S(0) under data parallelism). Changes ``chosen`` in place."""
        reads: dict[str, set] = {}
        for u, _, v, i in graph_edges(self.captured):
            if self.facts.kind[u] == "input":
                reads.setdefault(u, set()).add(None if v == OUTPUT else tuple(chosen[v].inputs[i]))
        for u, wanted in reads.items():
            want = next(iter(wanted))
            if len(wanted) != 1 or want is None or any(c != R_CODE for c in encode(chosen[u].outputs[0])):
                continue
            for k in self.allowed.get(u, range(len(self.table[u]))):
                if tuple(self.table[u][k].outputs[0]) == want:
                    chosen[u] = self.table[u][k]
                    break

    def solution(self, choice: list[int], *, optimizer: Union[str, float],
                 solver_stats: Optional[dict] = None, levers: Optional[Levers] = None) -> Solution:
        """The ILP's ``choice`` as a priced ``Solution``: strategies assigned, inputs settled, evaluated
        (under ``levers``, None: none pulled)."""
        chosen = self.strategies(choice)
        self.settle_inputs(chosen)
        return evaluate(self.captured, self.mesh, chosen, PlanContext.of(self.hardware, optimizer=optimizer),
                        unruled=self.table.unruled,
                        solver_stats=solver_stats, levers=levers)


def build_problem(captured: CapturedGraph, mesh, *, hardware: Hardware = PRESETS[DEFAULT_HARDWARE],
                  pins: Optional[Pins] = None, facts: Optional[GraphFacts] = None,
                  narrow: Optional[Callable[[StrategyTable, Mesh, dict], dict]] = None,
                  choices: Optional[tuple] = None) -> ShardingProblem:
    """The sharding problem of ``captured`` on ``mesh``: strategies, pins resolved, clusters.

    ``hardware``: resolved (``PlanContext.spec``). ``facts`` defaults to ``GraphFacts(captured, hardware)``
    (a subclass prices, e.g., one
    microbatch). ``narrow(table, mesh, allowed) -> allowed`` has the last say on the allowed
    strategies before nodes are clustered (nodes cluster only with equally restricted ones; it gets
    a copy of ``allowed``). ``choices``: ``strategy_choices``' answer, when already computed."""
    mesh, table, allowed = choices or strategy_choices(captured, mesh, pins)
    if narrow is not None:
        allowed = narrow(table, mesh, {k: set(v) for k, v in allowed.items()})
    hw = hardware
    facts = GraphFacts(captured, hw) if facts is None else facts
    clustering = cluster_nodes(captured, extra=lambda n: (
        len(table[n]), tuple(sorted(allowed[n])) if n in allowed else None, n in facts.requires_grad))
    return ShardingProblem(captured, mesh, hw, table, allowed, facts, clustering)
