"""Why a plan placed one node the way it did: the other strategies it had, priced against the choice.

``explain_node(problem, strategies, name, ...)`` takes a solved plan's strategies and one node (a
parameter's placeholder or an op). Every strategy the planner could have given that node is priced with
the plan's own cost model, the rest of the plan held as it is: the change applies to the node's whole
cluster (the copies of it in identical repeated blocks, which the ILP decides together), and its cost
is the change in the nodes' own prices (compute, gradient all-reduce, memory) plus the change on every
edge touching them (redistributions and their copies). Deltas are exact for the plan's additive
estimates (step time, and memory as the sum of ``memory_breakdown``: the bytes the ILP bounds, not
the step's peak ``estimated_memory``).

``binding`` says what kept the cheaper strategies out: the memory limit (they would not fit), nothing
(the choice is the cheapest given its neighbours), or the solver (a cheaper strategy fits; the ILP
stopped before proving optimality, or a move of several clusters at once is what makes the choice pay).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autoshard.passes.solve.context import PlanContext
from autoshard.passes.cost.model import CostModel
from autoshard.passes.solve.clustering import OUTPUT, graph_edges, output_placements
from autoshard.passes.solve.problem import ShardingProblem
from autoshard.passes.spec import Strategy
from autoshard.passes.writes import written_operands

__all__ = ["Alternative", "Explanation", "explain_node"]


@dataclass
class Alternative:
    """Another strategy for the node: seconds and bytes it adds to the step (negative: saves)."""
    strategy: Strategy
    time_delta: float
    memory_delta: float
    fits: bool


@dataclass
class Explanation:
    node: str
    kind: str
    chosen: Strategy
    cluster: list
    step_time: float
    memory: float
    memory_limit: float
    alternatives: list = field(default_factory=list)
    binding: str = ""

    @property
    def cheaper(self) -> list:
        return [a for a in self.alternatives if a.time_delta < -1e-15]


def _local_cost(problem: ShardingProblem, cm: CostModel, chosen: dict, nodes: set, edges: list) -> tuple[float, float]:
    """(seconds, bytes) of ``nodes``' own prices and of ``edges`` under the assignment ``chosen``."""
    seconds = memory = 0.0
    for name in nodes:
        price = cm.price_node(name, chosen[name], problem.facts)
        seconds += price.seconds
        memory += price.memory
    out_placements = output_placements(problem.captured, problem.mesh.ndim)
    for u, slot, v, i in edges:
        src = chosen[u].outputs[slot]
        dst = (out_placements or src) if v == OUTPUT else chosen[v].inputs[i]
        if tuple(src) == tuple(dst):
            continue
        grad = v != OUTPUT and problem.facts.value_needs_grad(u, slot)
        meta = problem.facts.tensor_outputs(u)[slot]
        colls, copy = cm.price_edge(src, dst, meta, grad)
        if v != OUTPUT and i in written_operands(problem.facts.nodes[v]):  # moved back after the op, as the ILP
            colls = colls + cm.price_edge(dst, src, meta, grad)[0]
        seconds += sum(c.seconds for c in colls)
        memory += copy
    return seconds, memory


def explain_node(problem: ShardingProblem, strategies: dict, name: str, ctx: PlanContext, *, cost_model: CostModel,
                 step_time: float, memory: float, status: Optional[str] = None) -> Explanation:
    """Explain node ``name`` of a plan whose strategies are ``strategies`` (module docstring), against
    ``ctx``'s memory limit."""
    memory_limit = ctx.memory_bytes
    table = problem.table[name]
    chosen_key = str(strategies[name])
    current = next((k for k, s in enumerate(table) if str(s) == chosen_key), None)
    cluster = next((list(m) for m in problem.clustering.members if name in m), [name])
    nodes = set(cluster)
    edges = [e for e in graph_edges(problem.captured) if e[0] in nodes or e[2] in nodes]
    base_s, base_m = _local_cost(problem, cost_model, strategies, nodes, edges)
    out = []
    for k, strategy in enumerate(table):
        if k == current or str(strategy) == chosen_key:
            continue
        trial = dict(strategies)
        for member in cluster:
            options = problem.table[member]
            trial[member] = options[k] if k < len(options) else strategy
        s, m = _local_cost(problem, cost_model, trial, nodes, edges)
        out.append(Alternative(strategy, s - base_s, m - base_m, memory + (m - base_m) <= memory_limit))
    out.sort(key=lambda a: (a.time_delta, a.memory_delta))
    explanation = Explanation(name, problem.facts.kind.get(name, "op"), strategies[name], cluster, step_time, memory,
                              memory_limit, out)
    cheaper = explanation.cheaper
    if not cheaper:
        explanation.binding = "none: no other strategy is faster for this node with its neighbours as planned"
    elif not any(a.fits for a in cheaper):
        explanation.binding = (f"memory: the {len(cheaper)} faster strateg{'y' if len(cheaper) == 1 else 'ies'} would "
                               f"exceed the memory limit")
    else:
        why = f"status {status}" if status and status != "OPTIMAL" else "optimal for moves of several clusters at once"
        explanation.binding = (f"solver ({why}): a faster strategy fits the memory limit when this cluster alone "
                               f"changes")
    return explanation
