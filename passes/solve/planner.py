"""The planner: strategies -> prices -> clusters -> ILP -> Solution.

>>> sol = plan_sharding(captured, Mesh.of((2, 2)), hardware="h100")      # doctest: +SKIP
>>> sol.param_placements["fc1.weight"], sol.solver_stats["status"]      # doctest: +SKIP
((R, S(0)), 'OPTIMAL')

``plan_sharding`` minimizes the estimated step time under a per-device memory limit (default: the
hardware's memory) and raises ``InfeasiblePlanError`` when nothing fits, after solving again for
the smallest memory any plan needs. The ILP has one node per cluster of identical layer nodes
(``clustering``), views and other followers folded into their producers (``ilp.merge_followers``),
so a 32-layer model solves as fast as a 2-layer one. ``random_solution`` draws a random valid strategy per node
(for randomized equivalence tests of the runtime). Both price the result with
``solution.evaluate``, the same cost model the ILP sees.
"""
from __future__ import annotations

import random
import time
from typing import Optional, Union

from autoshard.passes.solve.clustering import OUTPUT, Clustering, cluster_edges, cluster_nodes, graph_edges, output_slot
from autoshard.passes.cost.model import R_CODE, CostModel, GraphFacts, encode
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.graph import CapturedGraph, operands
from autoshard.passes.cost.hardware import Hardware, get_hardware
from autoshard.passes.solve.ilp import SGEdge, SGNode, StrategyGraph, solve
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.solution import Solution, evaluate
from autoshard.passes.spec import Partial, Replicate, Strategy, fmt_placements
from autoshard.passes.sharding.strategies import StrategyTable, enumerate_strategies

__all__ = ["plan_sharding", "random_solution", "build_strategy_graph", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _classes(items: list) -> tuple[list[int], list]:
    index: dict = {}
    cls = [index.setdefault(tuple(x), len(index)) for x in items]
    return cls, list(index)


def build_strategy_graph(captured: CapturedGraph, table: StrategyTable, allowed: dict[str, list[int]],
                         clustering: Clustering, cm: CostModel, facts: GraphFacts,
                         memory_limit: Optional[float]) -> StrategyGraph:
    """One ILP node per cluster (priced by its representative, counted ``len(members)`` times), one
    ILP edge per distinct cluster edge; the program's outputs are a fixed consumer wanting ``R``."""
    nodes: list[SGNode] = []
    for members in clustering.members:
        rep = members[0]
        prices = [cm.price_node(rep, s, facts) for s in table[rep]]
        nodes.append(SGNode(rep, [p.seconds for p in prices], [p.memory for p in prices], len(members),
                            allowed.get(rep)))
    out_index = len(nodes)
    nodes.append(SGNode(OUTPUT, [0.0], [0.0]))
    replicated = (R_CODE,) * cm.mesh.ndim
    codes: dict = {}

    def placements_of(name: str, side: str, k: int) -> list[tuple]:
        key = (name, side, k)
        if key not in codes:
            codes[key] = [encode(getattr(s, side)[k]) for s in table[name]]
        return codes[key]

    edges: list[SGEdge] = []
    for (cu, slot, cv, i), (mult, (u, _, v, _)) in cluster_edges(graph_edges(captured), clustering).items():
        u_class, srcs = _classes(placements_of(u, "outputs", slot))
        if cv == OUTPUT:
            v_class, dsts, vi = [0], [replicated], out_index
        else:
            v_class, dsts = _classes(placements_of(v, "inputs", i))
            vi = cv
        nbytes = facts.tensor_outputs(u)[slot].nbytes
        grad = cv != OUTPUT and facts.value_needs_grad(u, slot)  # an output's gradient seed is free
        cost, mem = [], []
        for p in srcs:
            row_c, row_m = [], []
            for q in dsts:
                colls, copy = cm.moves(p, q, nbytes, grad)
                row_c.append(sum(c.seconds for c in colls))
                row_m.append(copy)
            cost.append(row_c)
            mem.append(row_m)
        same = {q: k for k, q in enumerate(dsts)}
        edges.append(SGEdge(cu, vi, u_class, v_class, cost, mem, mult, [same.get(p, -1) for p in srcs]))
    return StrategyGraph(nodes, edges, memory_limit)


def _prepare(captured: CapturedGraph, mesh, pins: Optional[Pins]):
    mesh = Mesh.of(mesh)
    table = enumerate_strategies(captured, mesh)
    if pins is not None and not isinstance(pins, Pins):
        pins = Pins(**pins)
    allowed = pins.resolve(captured, table, mesh) if pins is not None else {}
    return mesh, table, allowed


def plan_sharding(captured: CapturedGraph, mesh, *, hardware: Union[str, Hardware] = "h100",
                  memory_limit: Optional[float] = None, pins: Optional[Pins] = None,
                  optimizer: Union[str, float] = "adamw", time_limit_s: float = 30.0,
                  workers: int = 2) -> Solution:
    """The cheapest plan (estimated step time) that fits ``memory_limit`` bytes per device."""
    t0 = time.perf_counter()
    mesh, table, allowed = _prepare(captured, mesh, pins)
    hw = get_hardware(hardware)
    limit = float(hw.memory_bytes if memory_limit is None else memory_limit)
    facts = GraphFacts(captured, hw)
    cm = CostModel(mesh, hw, optimizer)
    clustering = cluster_nodes(captured, extra=lambda n: (
        len(table[n]), tuple(allowed[n]) if n in allowed else None, n in facts.requires_grad))
    graph = build_strategy_graph(captured, table, allowed, clustering, cm, facts, limit)
    t_built = time.perf_counter()
    result = solve(graph, time_limit_s=time_limit_s, workers=workers)
    status = result.status
    if result.choice is None:
        smallest = solve(graph, objective="memory", time_limit_s=time_limit_s, workers=workers)
        if smallest.choice is None or smallest.memory > limit:
            raise _infeasible(captured, mesh, table, clustering, smallest, limit, hw, optimizer)
        result, status = smallest, "MEMORY_FALLBACK"
    chosen = _assign(table, clustering, result.choice)
    _settle_inputs(captured, table, allowed, chosen, facts)
    stats = {"status": status, "wall_s": round(time.perf_counter() - t0, 4), "solve_s": round(result.wall_s, 4),
             "build_s": round(t_built - t0, 4), "variables": result.num_variables,
             "constraints": result.num_constraints, "clusters": clustering.num_clusters,
             "nodes": len(chosen), "ilp_nodes": result.stats.get("ilp_nodes"), "ilp_edges": len(graph.edges),
             "objective_s": result.cost}
    return evaluate(captured, mesh, chosen, hw, optimizer, unruled=table.unruled, solver_stats=stats)


def _assign(table: StrategyTable, clustering: Clustering, choice: list[int]) -> dict[str, Strategy]:
    chosen: dict[str, Strategy] = {}
    for cid, members in enumerate(clustering.members):
        for name in members:
            chosen[name] = table[name][choice[cid]]
    return chosen


def _settle_inputs(captured, table, allowed, chosen: dict[str, Strategy], facts: GraphFacts) -> None:
    """An input (or the target) placed R whose consumers all read it one way takes that placement:
    the runtime chunks the global batch for free either way, and the plan then says what each rank
    gets (e.g. the batch S(0) under data parallelism)."""
    reads: dict[str, set] = {}
    for u, _, v, i in graph_edges(captured):
        if facts.kind[u] == "input":
            reads.setdefault(u, set()).add(None if v == OUTPUT else tuple(chosen[v].inputs[i]))
    for u, wanted in reads.items():
        want = next(iter(wanted))
        if len(wanted) != 1 or want is None or any(c != R_CODE for c in encode(chosen[u].outputs[0])):
            continue
        for k in allowed.get(u, range(len(table[u]))):
            if tuple(table[u][k].outputs[0]) == want:
                chosen[u] = table[u][k]
                break


def _infeasible(captured, mesh, table, clustering, smallest, limit, hw, optimizer) -> InfeasiblePlanError:
    if smallest.choice is None:
        return InfeasiblePlanError(
            f"no plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on mesh {mesh.shape}, "
            f"and the solver could not find the smallest plan in time ({smallest.status}); raise time_limit_s, "
            "use more devices or a larger memory_limit")
    sol = evaluate(captured, mesh, _assign(table, clustering, smallest.choice), hw, optimizer, unruled=table.unruled)
    need = sol.estimated_memory
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(sol.memory_breakdown.items(), key=lambda kv: -kv[1]))
    cm = CostModel(mesh, hw, optimizer)
    facts = GraphFacts(captured, hw)
    big = []
    for name, s in sol.strategies.items():
        price = cm.price_node(name, s, facts)
        label = captured.params.get(name) or name
        big.append((price.memory, label, facts.tensor_outputs(name), s))
    big.sort(key=lambda t: -t[0])
    tops = "; ".join(f"{label} {tuple(m[0].shape) if m else ''} {fmt_placements(s.outputs[0]) if s.outputs else ''}"
                     f" {human_bytes(b)}" for b, label, m, s in big[:5])
    return InfeasiblePlanError(
        f"no plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on mesh {mesh.shape}: the "
        f"smallest plan needs {int(need)} bytes ({human_bytes(need)}) per device ({parts}). Largest items per "
        f"device in that plan: {tops}. To relax: use more devices (a larger mesh), a larger memory_limit, a "
        f"lighter optimizer (optimizer='sgd' keeps no state), or a smaller batch.")


def random_solution(captured: CapturedGraph, mesh, *, seed: int, pins: Optional[Pins] = None,
                    hardware: Union[str, Hardware] = "h100", optimizer: Union[str, float] = "adamw") -> Solution:
    """A random valid strategy per node (pins respected), priced like a solved plan.

    Half the time an op takes a strategy whose operand placements match what its producers chose
    (so sharded chains form); strategies that turn a non-P operand into P are avoided when possible.
    """
    mesh, table, allowed = _prepare(captured, mesh, pins)
    rng = random.Random(seed)
    chosen: dict[str, Strategy] = {}
    replicated = tuple(Replicate() for _ in mesh.shape)  # what a get_attr constant holds
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        options = [table[node.name][k] for k in allowed.get(node.name, range(len(table[node.name])))]
        if node.op == "call_function" and len(options) > 1:
            have = [chosen[o.node.name].outputs[output_slot(o.node, o.index)] if o.node.name in chosen
                    else replicated for o in operands(node)]
            sane = [s for s in options if not any(isinstance(p, Partial) and not isinstance(h[a], Partial)
                                                  for pls, h in zip(s.inputs, have) for a, p in enumerate(pls))]
            options = sane or options
            match = [s for s in options if all(tuple(a) == tuple(b) for a, b in zip(s.inputs, have))]
            if match and rng.random() < 0.5:
                options = match
        chosen[node.name] = rng.choice(options)
    return evaluate(captured, mesh, chosen, hardware, optimizer, unruled=table.unruled,
                    solver_stats={"status": f"RANDOM(seed={seed})"})
