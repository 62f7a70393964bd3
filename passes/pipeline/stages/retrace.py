"""A pipeline plan moved from one trace of a program to another, and re-solved there.

The stage planner plans on the program traced at the GLOBAL batch; stage programs run the program
traced at the MICROBATCH size. The two traces need not match op for op (HF models build masks and
position ids from the batch size: at one sequence an ``expand`` goes away):

- ``match_nodes`` pairs ops position for position (and refuses traces that differ);
- ``align_nodes`` pairs them by the longest matching runs of (op, module path);
- ``retrace_stage_nodes`` moves each stage boundary onto its counterpart;
- ``microbatch_plan`` moves a saved plan's every decision onto the microbatch trace (nothing solved);
- ``replan_at_microbatch`` is the plan ``compile(pp=)`` runs: the same cut, groups, submeshes,
  schedule and microbatches on the microbatch trace, every stage's Solution re-solved there by the
  sharding planner (the user's ``params=`` pins that concern the stage applied, ``stage_pins``, and
  the memory levers: pinned ones as given, the others chosen for each stage, ``stage_levers``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import replace
from difflib import SequenceMatcher
from typing import Optional, Sequence

import torch.fx as fx

from autoshard.passes.errors import InfeasiblePlanError, PlanFormatError
from autoshard.passes.graph import MODULE, CapturedGraph
from autoshard.passes.pipeline.group_peak import group_peaks
from autoshard.passes.pipeline.stages.boundary_pieces import sent_placements
from autoshard.passes.pipeline.stages.stage_graphs import call_nodes, split_stages
from autoshard.passes.pipeline.plan import Plan, Stage
from autoshard.passes.pipeline.stages.stage_peak import stage_solution
from autoshard.passes.pipeline.stages.stage_zero import planned_zero_pins, storage_pins, pins_name_zero_forms, step_storage_collectives
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.levers import block_type, lever_rows
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.clustering import block_instance, module_path
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.solution import Redistribution, Solution

__all__ = ["block_types", "match_nodes", "align_nodes", "retrace_stage_nodes", "microbatch_plan", "replan_at_microbatch",
           "stage_pins", "stage_levers"]


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


def block_types(captured: CapturedGraph) -> list[str]:
    """The repeated-block types of a captured program ("layers.#"), in order of first op."""
    out: list[str] = []
    for node in captured.gm.graph.nodes:
        found = block_instance(module_path(node, captured)) if node.op == "call_function" else None
        if found and block_type(found[1]) not in out:
            out.append(block_type(found[1]))
    return out


def stage_levers(levers: Optional[LeverPins], stage_captured: CapturedGraph) -> Optional[LeverPins]:
    """The lever pins of one stage's solve: the step's ``levers`` (None: none pulled, as the stage
    planner prices stages) with its accumulation fixed at 1 (a pipeline accumulates over its
    microbatches and rounds, not inside a stage) and its per-block-type pins kept for the block types
    this stage holds (a stage of the embedding alone has none)."""
    if levers is None:
        return None
    kinds = block_types(stage_captured)

    def mine(pin):
        if not isinstance(pin, dict):
            return pin if kinds else None
        kept = {k: v for k, v in pin.items() if any(t == k or fnmatch.fnmatchcase(t, str(k)) for t in kinds)}
        return kept or None

    pins = {row.keyword: mine(getattr(levers, row.keyword)) if row.per_block else getattr(levers, row.keyword)
            for row in lever_rows()}
    return LeverPins(**{**pins, "accumulation": 1})


def _renamed(solution: Optional[Solution], names: dict[str, str]) -> Optional[Solution]:
    """``solution`` on the other trace: decisions about values it lacks are dropped."""
    if solution is None:
        return None
    moves = [Redistribution(names[r.producer], names[r.consumer], r.operand_index, r.src, r.dst, r.collectives)
             for r in solution.redistributions if r.producer in names and r.consumer in names]
    return replace(solution, strategies={names[k]: v for k, v in solution.strategies.items() if k in names},
                   redistributions=moves)


def microbatch_plan(plan: Plan, small: CapturedGraph) -> Plan:
    """``plan`` (made on ``plan.captured``, the program of one round) on ``small``, the same program
    traced at the microbatch size: every node renamed to its counterpart (ops by ``align_nodes``,
    placeholders by position), the stage boundaries moved with them (``retrace_stage_nodes``),
    decisions (levers included) and estimates unchanged. An op only the microbatch trace has gets no
    decision from the plan: ``PlanFormatError`` naming it (compile with ``pp=`` to plan at the
    microbatch instead)."""
    full = plan.captured
    names = align_nodes(full, small)
    a = [n.name for n in full.gm.graph.nodes if n.op == "placeholder"]
    b = [n.name for n in small.gm.graph.nodes if n.op == "placeholder"]
    if len(a) != len(b):
        raise PlanFormatError(f"the program traced at the microbatch size has {len(b)} placeholders, at the global "
                              f"batch {len(a)}: the model's parameters or inputs depend on the batch size")
    names.update(zip(a, b))
    stage_nodes = retrace_stage_nodes(full, small, [s.nodes for s in plan.stages])
    stages = []
    for s, nodes in zip(plan.stages, stage_nodes):
        solution = _renamed(s.solution, names)
        new = [n for n in nodes if solution is not None and n not in solution.strategies]
        if new:
            raise PlanFormatError(f"the program traced at the microbatch size has ops the plan's trace lacks "
                                  f"({new[:5]}, stage {s.index}); the saved plan has no decision for them: compile "
                                  "with pp= (and the plan's schedule and microbatches) to plan at the microbatch")
        stages.append(replace(s, nodes=nodes, solution=solution))
    return plan.with_stages(stages, captured=small)


def replan_at_microbatch(plan: Plan, full: CapturedGraph, small: CapturedGraph, ctx: PlanContext, *,
                         params: Optional[dict] = None, levers: Optional[LeverPins] = None) -> Plan:
    """The runtime's plan for ``plan``, a pipeline plan made on ``full`` (the program of one round):
    the same stage cut (``retrace_stage_nodes``), rank groups, stage submeshes, schedule,
    microbatches and estimates, on ``small`` (the program traced at microbatch shapes, which stage
    programs bake in), with every stage's intra-op Solution solved there by ``plan_sharding`` on the
    stage's submesh (``ctx``: its hardware, optimizer and time limit, with each stage's own memory bound;
    ``params``: the user's parameter pins, applied to the stages they concern; ``levers``: the memory
    levers, ``stage_levers`` of them for each stage: None pulls none). A Solution made at global
    shapes cannot be reused: its sizes differ, and it has no strategies for the values a stage
    receives. ``ctx.memory_bytes`` bounds each rank group's peak as the stage planner checked it
    (``group_peak``: a group of several stages at the schedule's worst moment; one stage: its whole-step
    peak, ``stage_peak``), not only the microbatch walk ``plan_sharding`` constrains: ``_fitted_stage``,
    stage by stage, the stages not yet re-solved as the planner priced them. The plan's ``accumulation``
    stays in every stage's levers."""
    stage_nodes = retrace_stage_nodes(full, small, [s.nodes for s in plan.stages])
    graphs = split_stages(small, stage_nodes)
    limit = ctx.memory_bytes
    rounds = plan.accumulation
    stages, sent = [], {}
    solved: dict[int, Solution] = {}  # the stages re-solved so far: their records stand for them in the group's peak
    shared: dict[str, tuple] = {}  # FQN of a tied weight -> the storage the first stage holding it gave it
    holders: dict[str, int] = {}
    for g in graphs:
        for fqn in set(g.captured.params.values()):
            holders[fqn] = holders.get(fqn, 0) + 1
    for i, s in enumerate(plan.stages):
        planned = {fqn: v for fqn, v in {**planned_zero_pins(s.solution, full), **shared}.items()
                   if not any(fnmatch.fnmatchcase(fqn, k) for k in params or {})}  # the user's pins win
        pins = stage_pins({**planned, **(params or {})}, graphs[i].captured)

        def solve(walk_limit: float, i=i, s=s, pins=pins):
            # ZeRO forms where the pins name them or the stage planner chose them (``stage_zero``)
            return plan_sharding(graphs[i].captured, s.mesh, ctx.limited(walk_limit), pins=pins,
                                 levers=stage_levers(levers, graphs[i].captured),
                                 storage_forms=pins_name_zero_forms(pins))
        arrivals = {n: sent[n] for n, _ in graphs[i].receives if n in sent}
        solution = _fitted_stage(solve, lambda sol, i=i, s=s, arrivals=arrivals: stage_solution(
            sol, graphs[i], plan.schedule, plan.pp, plan.microbatches, s.recompute, arrivals=arrivals),
            _stage_budget(plan, i, limit, solved), lambda sol, i=i: _group_peak(plan, i, sol, solved), limit)
        if rounds > 1:
            solution.levers = replace(solution.levers, accumulation=rounds)
        solution = step_storage_collectives(solution, graphs[i].captured, ctx, rounds * plan.microbatches)
        solved[i] = solution
        # a weight several stages hold (tied) is stored alike by all of them: the first holder's storage
        # binds the later ones (the runtime refuses a weight stored two ways in a ZeRO form)
        shared.update({fqn: v for fqn, v in storage_pins(solution, graphs[i].captured).items()
                       if fqn not in shared and holders.get(fqn, 0) > 1})
        sent.update(sent_placements(graphs[i], solution.strategies, [st.mesh for st in plan.stages]))
        stages.append(Stage(s.index, stage_nodes[i], s.group, list(s.ranks), s.mesh, solution, s.recompute))
    return plan.with_stages(stages, captured=small)


#: re-solves of a stage whose whole-step peak overshoots its budget
REFITS = 2


def _group_peak(plan: Plan, i: int, solution: Solution, solved: dict[int, Solution]) -> float:
    """Stage ``i``'s rank group's peak (``group_peak``: at the schedule's worst moment when every stage
    has its memory record) with ``solution`` as stage ``i``, the stages already re-solved as ``solved``
    and the others as the planner priced them: what the stage planner checked against the limit."""
    def of(s):
        sol = solution if s.index == i else solved.get(s.index, s.solution)
        return (s.index, s.group, None if sol is None else sol.estimated,
                0.0 if sol is None else float(sol.estimated_memory))
    return group_peaks([of(s) for s in plan.stages], plan.schedule, plan.pp, plan.microbatches)[plan.stages[i].group]


def _stage_budget(plan: Plan, i: int, limit: float, solved: dict[int, Solution]) -> float:
    """Stage ``i``'s first walk limit on its rank group: ``limit`` less what the group's other stages
    (virtual stages) keep whatever runs (their idle bytes, ``group_peak``; a stage without a record:
    its whole peak), or ``limit / v`` if they leave nothing. Generous on purpose: at the group's worst
    moment the others also hold microbatches, and ``_fitted_stage`` lowers the walk limit by how far
    the group's peak overshoots, where a limit too low to solve at all would fail the compile."""
    mine = plan.stages[i]
    group = [s for s in plan.stages if s.group == mine.group]
    others = 0.0
    for s in group:
        sol = solved.get(s.index, s.solution)
        if s.index == mine.index or sol is None:
            continue
        others += float(sol.estimated.get("stage_idle_bytes", sol.estimated_memory))
    return limit - others if limit - others > 0 else limit / len(group)


def _fitted_stage(solve, peak_of, budget: float, group_peak=None, limit: Optional[float] = None):
    """The stage's Solution with its memory within bounds: ``solve(walk_limit)`` bounds one microbatch's
    walk only, and ``peak_of`` makes the stage's whole-step Solution of it. Its memory is
    ``group_peak(solution)`` against ``limit`` (the rank group's peak with this stage in it) when both
    are given, else its own whole-step peak against ``budget``. A stage that overshoots (in-flight
    microbatches, accumulated gradients, p2p buffers, the group's other stages) is solved again under a
    walk limit (first ``budget``) lowered by the overshoot, up to ``REFITS`` times; the leanest if none
    fits (an ``InfeasiblePlanError`` of the first solve is raised)."""
    if group_peak is None or limit is None:
        group_peak, limit = (lambda sol: float(sol.estimated_memory)), budget
    walk_limit, best, least = budget, None, None
    for _ in range(1 + REFITS):
        try:
            solution = peak_of(solve(walk_limit))
        except InfeasiblePlanError:
            if best is None:
                raise
            break
        need = group_peak(solution)
        if best is None or need < least:
            best, least = solution, need
        if need <= limit:
            return solution
        walk_limit -= need - limit
        if walk_limit <= 0:
            break
    return best
