"""Pipeline ``Plan``s built by hand: the stages named, the rest (rank groups, submeshes) derived.

>>> make_pipeline_plan(captured, stage_nodes_from_prefixes(captured, ["blocks.2"]), (2, 2),   # doctest: +SKIP
...                    schedule="1f1b", microbatches=4, solve=solve_stage)

Tests, benchmarks and examples pin a pipeline this way; ``autoshard.plan(..., pp=...)`` plans one
with the stage planner (``passes.pipeline.stages.planner``) instead.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.generators import stage_rank
from autoshard.passes.pipeline.stages.boundary_pieces import sent_placements
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph, split_stages
from autoshard.passes.pipeline.stages.stage_peak import stage_solution
from autoshard.passes.pipeline.plan import Plan, Stage
from autoshard.passes.pipeline.plan_file import graph_fingerprint
from autoshard.passes.solve.solution import Solution

__all__ = ["stage_group", "make_pipeline_plan"]


def stage_group(schedule: str, pp: int, virtual: int, stage: int) -> int:
    """The rank group running ``stage`` (``generators.stage_rank``: round robin for loop schedules, a V
    (0..p-1, then p-1..0) for zbv/dualpipev)."""
    return stage_rank(schedule, pp, virtual)[stage]


def make_pipeline_plan(captured: CapturedGraph, stage_nodes: Sequence[Sequence[str]], mesh, *, schedule: str,
                       microbatches: int, virtual: int = 1,
                       solve: Optional[Callable[[StageGraph, Mesh], Solution]] = None) -> Plan:
    """A ``Plan`` of ``captured`` from stage node lists on the physical ``mesh`` (its first axis = pp
    groups; the rest is each group's submesh, ``(1,)`` for a 1-D mesh). ``solve(stage_graph, submesh)``
    returns the stage's intra-op Solution (None leaves it unplanned)."""
    mesh = Mesh.of(mesh)
    pp = mesh.shape[0]
    n = len(stage_nodes)
    if n != pp * virtual:
        raise PlanFormatError(f"{n} stages but pp * virtual = {pp} * {virtual} = {pp * virtual}; give one node "
                              "list per stage")
    sub = Mesh(mesh.shape[1:], mesh.axis_names[1:]) if mesh.ndim > 1 else Mesh((1,))
    graphs = split_stages(captured, stage_nodes)
    stages, sent = [], {}
    for s, g in enumerate(graphs):
        grp = stage_group(schedule, pp, virtual, s)
        ranks = list(range(grp * sub.size, (grp + 1) * sub.size))
        sol = solve(g, sub) if solve is not None else None
        arrivals = {n: sent[n] for n, _ in g.receives if n in sent}
        stages.append(Stage(s, list(stage_nodes[s]), grp, ranks, sub,
                            stage_solution(sol, g, schedule, pp, int(microbatches), arrivals=arrivals)))
        if sol is not None:
            sent.update(sent_placements(g, sol.strategies, [sub] * n))
    return Plan(stages, mesh, schedule, int(microbatches), fingerprint=graph_fingerprint(captured), captured=captured)
