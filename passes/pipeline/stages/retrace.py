"""A pipeline plan moved from one trace of a program to another, and re-solved there.

The stage planner plans on the program traced at the GLOBAL batch; stage programs run the program
traced at the MICROBATCH size. The two traces need not match op for op (HF models build masks and
position ids from the batch size: at one sequence an ``expand`` goes away):

- ``match_nodes`` pairs ops position for position (and refuses traces that differ);
- ``align_nodes`` pairs them by the longest matching runs of (op, module path);
- ``retrace_stage_nodes`` moves each stage boundary onto its counterpart;
- ``replan_at_microbatch`` is the plan ``compile(pp=)`` runs: the same cut, groups, submeshes,
  schedule and microbatches on the microbatch trace, every stage's Solution re-solved there by the
  sharding planner (the user's ``params=`` pins that concern the stage applied, ``stage_pins``).
"""
from __future__ import annotations

import fnmatch
from difflib import SequenceMatcher
from typing import Any, Optional, Sequence

import torch.fx as fx

from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import InfeasiblePlanError, PlanFormatError
from autoshard.passes.graph import MODULE, CapturedGraph
from autoshard.passes.pipeline.stages.boundary_pieces import sent_placements
from autoshard.passes.pipeline.stages.stage_graphs import call_nodes, split_stages
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan, StagePlan
from autoshard.passes.pipeline.stages.stage_peak import stage_solution
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.planner import plan_sharding

__all__ = ["match_nodes", "align_nodes", "retrace_stage_nodes", "replan_at_microbatch", "stage_pins"]


def match_nodes(full: CapturedGraph, small: CapturedGraph) -> dict[str, str]:
    """call_function node name in ``full`` -> the same op's name in ``small``: the same program traced
    at another batch size. Ops pair up in graph order and must call the same targets; raises
    ``PlanFormatError`` when the two traces differ (a batch-size-dependent program)."""
    a, b = call_nodes(full), call_nodes(small)
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x.target != y.target), None)
    if len(a) != len(b) or diff is not None:
        where = (f"op {diff}: {a[diff].name} ({a[diff].target}) vs {b[diff].name} ({b[diff].target})"
                 if diff is not None else f"{len(a)} ops vs {len(b)}")
        raise PlanFormatError(f"the program traced at the global batch and at the microbatch size differ ({where}); "
                              "the model's ops depend on its batch size, so a pipeline plan made at one cannot run at "
                              "the other: pin stages= by hand, or make the forward independent of the batch size")
    return {x.name: y.name for x, y in zip(a, b)}


#: how many ops may differ between two traces of one program at two batch sizes (on either side)
_RETRACE_SLACK = 0.1


def _aligned(full: CapturedGraph, small: CapturedGraph) -> dict[int, int]:
    """Op position in ``full`` -> its counterpart's in ``small`` (see ``align_nodes``)."""
    a, b = call_nodes(full), call_nodes(small)

    def key(n: fx.Node):
        return str(n.target), n.meta.get(MODULE, "")

    ka, kb = [key(n) for n in a], [key(n) for n in b]
    if ka == kb:
        return {i: i for i in range(len(a))}
    matched: dict[int, int] = {}
    for blk in SequenceMatcher(None, ka, kb, autojunk=False).get_matching_blocks():
        matched.update((blk.a + k, blk.b + k) for k in range(blk.size))
    slack = max(2, int(_RETRACE_SLACK * len(a)))
    if len(a) - len(matched) > slack or len(b) - len(matched) > slack:
        first = next((i for i in range(min(len(a), len(b))) if ka[i] != kb[i]), min(len(a), len(b)))
        where = f"op {first}: {a[first].name} ({a[first].target})" if first < len(a) else f"{len(a)} ops vs {len(b)}"
        raise PlanFormatError(f"the program traced at the global batch and at the microbatch size differ in "
                              f"{len(a) - len(matched)} of {len(a)} ops (first at {where}); the model's structure "
                              "depends on its batch size, so a pipeline plan made at one cannot run at the other: pin "
                              "stages= by hand, or make the forward independent of the batch size")
    return matched


def align_nodes(full: CapturedGraph, small: CapturedGraph) -> dict[str, str]:
    """call_function node name in ``full`` -> its counterpart's in ``small``, the same program traced at
    another batch size: every op, position for position, when the traces match; otherwise the ops an
    alignment of the two op sequences by (target, module path) pairs up (longest matching runs), ops
    only one trace has left out. Raises ``PlanFormatError`` when the traces differ in more than a few
    ops (another program, or one whose structure depends on the batch size)."""
    a, b = call_nodes(full), call_nodes(small)
    return {a[i].name: b[j].name for i, j in _aligned(full, small).items()}


def retrace_stage_nodes(full: CapturedGraph, small: CapturedGraph,
                        stage_nodes: Sequence[Sequence[str]]) -> list[list[str]]:
    """``stage_nodes`` (a partition of ``full``'s ops, in graph order) moved onto ``small``, the same
    program traced at another batch size (``align_nodes``): each boundary at its op's counterpart, or
    right after the counterpart of the last op before it that has one; ops only ``small`` has stay
    inside the stage around them."""
    a, b = call_nodes(full), call_nodes(small)
    matched = _aligned(full, small)
    pos = {n.name: i for i, n in enumerate(a)}
    starts = [0]
    for nodes in stage_nodes[1:]:
        i = min(pos[n] for n in nodes)
        if i in matched:
            starts.append(matched[i])
        else:
            before = [matched[k] for k in range(i) if k in matched]
            starts.append(before[-1] + 1 if before else 0)
    starts.append(len(b))
    if any(y <= x for x, y in zip(starts, starts[1:])):
        raise PlanFormatError(f"the stage boundaries land on ops {starts[1:-1]} of the program traced at the "
                              "microbatch size, leaving a stage empty; pin stages= by hand")
    return [[n.name for n in b[x:y]] for x, y in zip(starts, starts[1:])]


def stage_pins(params: Optional[dict], stage_captured: CapturedGraph) -> Optional[Pins]:
    """The parameter pins (fnmatch pattern -> placements) that concern this stage: patterns matching
    one of its parameters. None when none does."""
    names = set(stage_captured.params.values()) | set(stage_captured.aliases)
    mine = {k: v for k, v in (params or {}).items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    return Pins(params=mine) if mine else None


def replan_at_microbatch(plan: PipelinePlan, full: CapturedGraph, small: CapturedGraph, *, hardware: Any,
                         memory_limit: Optional[int] = None, optimizer: str = "adamw", time_limit_s: float = 30.0,
                         params: Optional[dict] = None) -> PipelinePlan:
    """The runtime's plan for ``plan``, a pipeline plan made on ``full`` (the program at global-batch
    shapes): the same stage cut (``retrace_stage_nodes``), rank groups, stage submeshes, schedule,
    microbatches and estimates, on ``small`` (the program traced at microbatch shapes, which stage
    programs bake in), with every stage's intra-op Solution solved there by ``plan_sharding`` on the
    stage's submesh (``hardware``, ``memory_limit``, ``optimizer``, ``time_limit_s`` as it takes them;
    ``params``: the user's parameter pins, applied to the stages they concern). A Solution made at
    global shapes cannot be reused: its sizes differ, and it has no strategies for the values a stage
    receives. ``memory_limit`` bounds each stage's whole-step peak (``stage_peak``), not only the
    microbatch walk ``plan_sharding`` constrains: ``_fitted_stage``."""
    stage_nodes = retrace_stage_nodes(full, small, [s.nodes for s in plan.stages])
    graphs = split_stages(small, stage_nodes)
    limit = float(memory_limit) if memory_limit is not None else get_hardware(hardware).memory_bytes
    stages, sent = [], {}
    for i, s in enumerate(plan.stages):
        def solve(walk_limit: float, i=i, s=s):
            return plan_sharding(graphs[i].captured, s.mesh, hardware=hardware, memory_limit=walk_limit,
                                 optimizer=optimizer, time_limit_s=time_limit_s,
                                 pins=stage_pins(params, graphs[i].captured))
        arrivals = {n: sent[n] for n, _ in graphs[i].receives if n in sent}
        solution = _fitted_stage(solve, lambda sol, i=i, s=s, arrivals=arrivals: stage_solution(
            sol, graphs[i], plan.schedule, plan.pp, plan.microbatches, s.recompute, arrivals=arrivals),
            _stage_budget(plan, i, limit))
        sent.update(sent_placements(graphs[i], solution.strategies, [st.mesh for st in plan.stages]))
        stages.append(StagePlan(s.index, stage_nodes[i], s.group, list(s.ranks), s.mesh, solution, s.recompute))
    return PipelinePlan(plan.pp, plan.virtual, stages, plan.schedule, plan.microbatches, plan.estimated_step_time,
                        plan.bubble_fraction, list(plan.peak_activation_memory))


#: re-solves of a stage whose whole-step peak overshoots its budget
REFITS = 2


def _stage_budget(plan: PipelinePlan, i: int, limit: float) -> float:
    """Stage ``i``'s share of ``limit`` on its rank group: what the planner's other stages of the group
    (virtual stages) leave of it (``limit / v`` if they leave nothing)."""
    mine = plan.stages[i]
    group = [s for s in plan.stages if s.group == mine.group]
    others = sum(float(s.solution.estimated_memory) for s in group if s.index != mine.index and s.solution is not None)
    return limit - others if limit - others > 0 else limit / len(group)


def _fitted_stage(solve, peak_of, budget: float):
    """The stage's Solution with its whole-step peak (``peak_of``) within ``budget``: ``solve(limit)``
    bounds one microbatch's walk only, so a stage whose peak (in-flight microbatches, accumulated
    gradients, p2p buffers) overshoots is solved again under a walk limit lowered by the overshoot,
    up to ``REFITS`` times; the leanest peak if none fits (an ``InfeasiblePlanError`` of the first
    solve is raised)."""
    walk_limit, best = budget, None
    for _ in range(1 + REFITS):
        try:
            solution = peak_of(solve(walk_limit))
        except InfeasiblePlanError:
            if best is None:
                raise
            break
        if best is None or solution.estimated_memory < best.estimated_memory:
            best = solution
        if solution.estimated_memory <= budget:
            return solution
        walk_limit -= float(solution.estimated_memory) - budget
        if walk_limit <= 0:
            break
    return best
