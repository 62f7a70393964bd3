"""What the ops without a sharding rule cost: they run replicated, whole on every device.

An op with no rule has one strategy, all-replicated (``passes.sharding.strategies``), so its cost
does not depend on the plan: every device holds its whole outputs and does its whole work, forward
and backward. ``replicated_op_costs`` adds that up per op name, with what the same outputs would
take split evenly over the mesh; ``describe_replicated`` words it for the plan summary and for
``InfeasiblePlanError``, with the remedy (``autoshard.register_sharding``).

>>> costs = replicated_op_costs(captured, Mesh.of((2, 2)), PRESETS["h100"])  # doctest: +SKIP
>>> costs[0].op, costs[0].nodes, costs[0].output_bytes, costs[0].seconds  # doctest: +SKIP
('mylib.fused_rope.default', 4, 33554432, 0.00031)
>>> print(describe_replicated(costs, Mesh.of((2, 2))))                    # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.strategies import unruled_ops
from autoshard.passes.units import human_bytes, human_time

__all__ = ["ReplicatedOp", "replicated_op_costs", "describe_replicated", "REGISTER_HINT"]

REGISTER_HINT = ("register a sharding rule with autoshard.register_sharding(op) (see its docstring) so the "
                 "planner may split them")


@dataclass(frozen=True)
class ReplicatedOp:
    """One op name without a rule: how many nodes run it, the bytes of their outputs on EVERY device
    (``output_bytes``; activations autograd may keep), and their forward + backward seconds per step
    on every device (``seconds``, launch overhead included)."""
    op: str
    nodes: int
    output_bytes: float
    seconds: float

    def split_bytes(self, mesh: Mesh) -> float:
        """The same outputs split evenly over every device of ``mesh``."""
        return self.output_bytes / mesh.size


def replicated_op_costs(captured: CapturedGraph, mesh, hardware: Hardware) -> list[ReplicatedOp]:
    """Every op without a sharding rule in ``captured``, costliest outputs first, priced on ``hardware``
    (resolved: ``PlanContext.spec``)."""
    mesh = Mesh.of(mesh)
    unruled = unruled_ops(captured)
    if not unruled:
        return []
    facts = GraphFacts(captured, hardware)
    totals: dict[str, list] = {}
    for node, op in unruled.items():
        t = totals.setdefault(op, [0, 0.0, 0.0])
        fwd, bwd = facts.compute(node)
        t[0] += 1
        t[1] += 0.0 if node in facts.views else sum(m.nbytes for m in facts.tensor_outputs(node))
        t[2] += fwd + bwd + facts.overhead(node)
    found = [ReplicatedOp(op, n, b, s) for op, (n, b, s) in totals.items()]
    return sorted(found, key=lambda r: (-r.output_bytes, -r.seconds, r.op))


def describe_replicated(costs: list[ReplicatedOp], mesh) -> str:
    """One sentence naming each op that runs replicated for lack of a rule, with its cost, and the remedy;
    "" when there is none."""
    if not costs:
        return ""
    mesh = Mesh.of(mesh)
    parts = [f"{c.op} ({c.nodes} node{'s' if c.nodes != 1 else ''}: outputs {human_bytes(c.output_bytes)} per "
             f"device, {human_bytes(c.split_bytes(mesh))} if split over the {mesh.size} devices; "
             f"{human_time(c.seconds)} per step)" for c in costs]
    return (f"Ops run replicated for lack of a sharding rule: {'; '.join(parts)}. To let them shard, "
            f"{REGISTER_HINT}.")
