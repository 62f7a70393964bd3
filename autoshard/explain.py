"""``explain(plan, name)``: why a plan placed a parameter or an op the way it did.

The plan must carry its captured graph (a plan from ``autoshard.plan``, or a loaded one re-attached with
``Plan.attach``; ``autoshard explain`` rebuilds the model from the plan file's ``source``). The node's
other strategies are priced with the plan's cost model against the choice
(``passes.solve.explain.explain_node``); ``format_explanation`` prints them.

>>> print(format_explanation(explain(plan, "model.layers.0.mlp.up_proj.weight")))   # doctest: +SKIP
"""
from __future__ import annotations

import difflib
from typing import Optional

from autoshard.passes.solve.context import PlanContext
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.solve.explain import Explanation, explain_node
from autoshard.passes.solve.problem import build_problem
from autoshard.passes.spec import fmt_placements
from autoshard.passes.units import human_bytes, human_time

__all__ = ["explain", "format_explanation", "node_for"]


def node_for(plan, name: str) -> str:
    """The graph node a parameter name (tied aliases too) or an op name refers to; PlanFormatError with
    the closest names otherwise."""
    captured = plan.captured
    canonical = captured.aliases.get(name, name)
    for ph, fqn in list(captured.params.items()) + list(captured.buffers.items()):
        if fqn == canonical:
            return ph
    if name in plan.solution.strategies:
        return name
    known = list(captured.params.values()) + list(captured.aliases) + list(plan.solution.strategies)
    close = difflib.get_close_matches(name, known, n=5)
    raise PlanFormatError(f"the plan has no parameter or op named {name!r}" +
                          (f"; close: {close}" if close else "; name a parameter (model.named_parameters()) or an "
                           "op node of the captured graph"))


def explain(plan, name: str, *, memory_limit: Optional[float] = None, optimizer: Optional[str] = None) -> Explanation:
    """Explain the placement of parameter or op ``name`` in ``plan`` (module docstring).
    ``memory_limit`` / ``optimizer`` default to the plan's source, else the hardware's memory and AdamW."""
    if plan.pipelined:
        raise PlanFormatError("explain reads plans without a pipeline: a pipelined plan's stages each have their "
                              "own Solution (plan.stages[s].solution)")
    if plan.captured is None:
        raise PlanFormatError("this plan has no captured graph: attach it to its model's graph first "
                              "(Plan.attach), or run `autoshard explain` on a plan file written by `autoshard plan`")
    source = plan.source or {}
    limit = memory_limit if memory_limit is not None else source.get("memory_limit") or None
    ctx = PlanContext.of(plan.hardware, limit, optimizer or source.get("optimizer") or None)
    node = node_for(plan, name)
    problem = build_problem(plan.captured, plan.mesh, hardware=ctx.spec)
    return explain_node(problem, plan.solution.strategies, node, ctx,
                        cost_model=CostModel(plan.mesh, ctx.spec, ctx.optimizer), step_time=plan.estimated_step_time,
                        memory=sum(plan.solution.memory_breakdown.values()),
                        status=plan.solution.solver_stats.get("status"))


def _signed_time(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + human_time(abs(seconds))


def _signed_bytes(n: float) -> str:
    return ("+" if n >= 0 else "-") + human_bytes(abs(n))


def format_explanation(e: Explanation, name: Optional[str] = None, top: int = 5) -> str:
    """The explanation as text: the choice, the ``top`` next-best strategies, the binding constraint."""
    what = f"{name} (node {e.node})" if name and name != e.node else e.node
    pls = lambda s: fmt_placements(s.outputs[0]) if e.kind in ("param", "buffer", "input") else str(s)  # noqa: E731
    lines = [f"{what}: {e.kind}, chosen {pls(e.chosen)}",
             f"  plan: step {human_time(e.step_time)}, memory (additive, as the ILP counts it) {human_bytes(e.memory)} of "
             f"{human_bytes(e.memory_limit)} on the busiest device"]
    if len(e.cluster) > 1:
        lines.append(f"  decided with {len(e.cluster) - 1} identical node(s) in repeated blocks; deltas change all "
                     f"{len(e.cluster)}")
    if not e.alternatives:
        lines.append("  no other strategy divides over this mesh")
    else:
        lines.append(f"  next best of {len(e.alternatives)} other strategies (the rest of the plan as it is):")
        width = max(len(pls(a.strategy)) for a in e.alternatives[:top])
        for a in e.alternatives[:top]:
            note = "" if a.fits else "  exceeds the memory limit"
            lines.append(f"    {pls(a.strategy):<{width}}  time {_signed_time(a.time_delta):>11}  "
                         f"memory {_signed_bytes(a.memory_delta):>12}{note}")
    lines.append(f"  binding: {e.binding}")
    return "\n".join(lines)
