"""Automatic 3D parallelism: pipeline stages, submesh shapes, microbatches, schedule and recompute,
chosen jointly with the intra-op (data / tensor / FSDP) plan of every stage.

>>> plan = plan_pipeline(captured, (2, 8), PlanContext.of(slow_network))  # doctest: +SKIP
>>> plan.pp, plan.stages[0].mesh.shape, plan.schedule, plan.microbatches  # doctest: +SKIP
(2, (8, 1), 'zb-h1', 64)

The search (Alpa's decomposition, Zheng et al. 2022, with CP-SAT for the inter-op part):

1. Layer units (``layer_costs.layer_units``): the program as a chain (embedding, blocks, head), or,
   with no numbered block (or when a pinned pp needs more stages than the blocks give), cut at op
   boundaries where few tensors are live (``op_cuts``). Asking for
   more stages than units (or more rank groups than units reading a parameter) is a
   ``StageCutError``, not a memory error.
2. Candidate configurations: ``pp`` divides the physical mesh's first axis (rank group g owns the
   contiguous block of ranks g*G .. (g+1)*G-1, G = world / pp); each group runs a logical (dp, tp)
   submesh with tp inside one node (``layer_costs.submesh_shapes``); the pipeline hop between
   groups uses the first axis's link (``Hardware.axis_link``: the NIC across nodes, NVLink within).
3. Intra-op plan per (pp, submesh shape): the core ILP on the whole program priced per microbatch,
   with activations held as a 1F1B stage holds them, under pp x the memory limit
   (``candidate_plan.plan_submesh``; parameters may be stored in ZeRO-1/2 forms, chosen per parameter and
   data axis where they pay or are needed to fit); then priced per unit (``layer_costs.profile_submesh``).
   Identical blocks share costs and decisions. Every candidate's ILP first runs with a short cap;
   the few whose plans search best are re-solved with a longer one, from what is left of half of
   ``time_limit_s`` (deterministic work) after the first pass (``search.plan_candidates``).
   A candidate nothing fits gets the least-memory plan (never replicated weights); one whose plan
   no balanced stage cut fits is planned again leaner (``stage_fit``), and the best-ranked finalist
   is also tried under a tighter budget, so more memory never turns a candidate infeasible.
4. Per (pp, shape, microbatches m, schedule): ``stage_ilp.solve_stages`` picks the contiguous unit
   ranges and per-stage recompute minimizing the closed-form step time under the memory limit, with
   the activations the schedule keeps in flight (the simulator's peak per stage). Every
   configuration first gets the balanced cut (``stage_cuts.balanced_stages``); the ILP refines the
   best few and those the balanced cut cannot fit; every configuration whose closed form can still
   win is also tried with the even cut by unit count, simulated (``search_stages``).
5. Every answer is re-timed by the schedule simulator (``scoring.score_stages``): the plan with
   the smallest SIMULATED step time, each group's gradient all-reduce overlapped with the backward
   still running after its last microbatch's gradients are ready, then its optimizer step and
   gradient accumulations, wins, and that is the plan's ``estimated_step_time``. Configurations whose bound m * work / pp already exceeds the best are
   skipped. ``pp = 1`` is the core plan on the whole mesh, its gradient sync overlapped with its
   backward by the same rule (``scoring.single_stage_step``), so both sides are timed alike.

The search lives in ``search.py`` (candidates, stage search) and ``scoring.py`` (simulated step
time); this module is the front door: pins, the pp = 1 comparison, and building the ``Plan``
(``passes.pipeline.plan``: its stages, schedule and simulated estimates).

Pins (``search_spec.PipelinePins``): ``pp``, ``schedule``, ``microbatches``, ``stages`` (the first unit of
every stage after the first, as unit indices or node names; its length + 1 is the number of stages), and
a layout's submesh shapes, recompute, placements and communication. Nothing fits ->
``InfeasiblePlanError`` saying what to relax.
"""
from __future__ import annotations

import time
from typing import Optional

from autoshard.passes.errors import AutoshardError, InfeasiblePlanError, StageCutError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import Levers
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import HintsFor
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.solution import Solution
from autoshard.passes.pipeline.schedule.generators import stage_rank
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.layer_costs import LayerUnit, SubmeshProfile, layer_units, profile_submesh
from autoshard.passes.pipeline.stages.op_cuts import cut_points, op_graph_units
from autoshard.passes.pipeline.schedule.simulate import ScheduleError
from autoshard.passes.pipeline.group_peak import memory_record
from autoshard.passes.pipeline.stages.scoring import (DEFAULT_SCHEDULES, Choice, held_microbatches, score_stages, single_stage_step,
                      stage_problem, valid_schedule)
from autoshard.passes.pipeline.stages.search import global_batch, microbatch_options, plan_candidates, profile_candidates, search_stages
from autoshard.passes.pipeline.stages.shallow import ShallowProgram, shallow_program
from autoshard.passes.pipeline.stages.search_spec import PipelinePins, PipelineSearch
from autoshard.passes.pipeline.plan import Plan, Stage
from autoshard.passes.pipeline.plan_file import graph_fingerprint
from autoshard.passes.pipeline.plan_work import hardware_label, plan_work
from autoshard.passes.units import human_bytes
from autoshard.passes.gc_pauses import fewer_gc_pauses

__all__ = ["plan_pipeline", "PipelinePins", "profile_candidates", "search_stages", "score_stages", "stage_problem",
           "held_microbatches", "microbatch_options", "Choice", "global_batch", "DEFAULT_SCHEDULES", "virtual_stages"]


# ---- the front door --------------------------------------------------------------------------
@fewer_gc_pauses
def plan_pipeline(captured: CapturedGraph, mesh, ctx: Optional[PlanContext] = None,
                  pins: PipelinePins = PipelinePins(), *, fold_blocks: bool = True,
                  hints_for: Optional[HintsFor] = None) -> Plan:
    """The fastest plan (simulated step time) that fits ``ctx``'s memory limit per device (``ctx``: the
    settings every planner reads, None for the default context; ``ctx.time_limit_s`` bounds the whole
    search's solves in deterministic work), pinned as ``pins`` says (``PipelinePins``), a ``Plan`` of
    ``captured`` on ``mesh``: ``pp == 1`` means "no pipeline": one stage, the core plan on the whole mesh
    (``stages[0].solution``), its step time with the gradient sync overlapped (``simulated_step_time``).

    ``fold_blocks``: a program with many identical blocks is priced through its shallow copy
    (``shallow.shallow_program``: each kept block counted for the cut ones); the stages, their
    intra-op plans and the core plan are still the deep program's. False prices every block.
    ``pins.pins_for(program, submesh)`` is applied to every intra-op solve (each candidate's, on the
    shallow copy when there is one, and the core plan's on the whole mesh). ``overlap_grad_sync`` (DDP's
    buckets: the default) and ``scatter_gather`` (Megatron-LM's ``scatter_gather_tensors_in_pipeline``;
    ``scoring.cut_seconds``) price how the runtime communicates. ``hints_for``: known plans' pins that
    every candidate's solve starts from (``search.profile_candidates``)."""
    t0 = time.perf_counter()
    ctx = PlanContext.given(ctx)
    mesh = Mesh.of(mesh)
    pp, microbatches, stages, pins_for = pins.pp, pins.microbatches, pins.stages, pins.pins_for
    time_limit_s, limit = ctx.time_limit_s, ctx.memory_bytes
    schedules = _schedules(pins.schedule)
    keep = [b for b in stages or () if isinstance(b, str)]
    units = layer_units(captured, keep=keep)
    if (pp is not None and pp > 1 and any(u.block is not None for u in units)
            and all(isinstance(b, str) for b in stages or ()) and not _cuttable(captured, units, [pp], schedules)):
        # more stages than blocks: cut inside them, on the op graph
        units = [LayerUnit(name, None, tuple(nodes)) for name, nodes in op_graph_units(captured, keep=keep)]
    starts = _resolve_stages(stages, units)
    pps = _pp_options(mesh, pp, len(units), starts, schedules)
    _check_stage_counts(captured, units, pps, schedules)
    batch = global_batch(captured)
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise AutoshardError(f"microbatches={microbatches} does not divide the global batch {batch}; use a divisor "
                             f"of {batch}")
    if microbatches is not None and not any(p == 1 or valid_schedule(s, p, microbatches) for p in pps for s in schedules):
        why = "; ".join(sorted({get_schedule(s).problem(p, microbatches) for p in pps for s in schedules}))
        raise ScheduleError(f"no schedule asked for runs {microbatches} microbatches on pp in {pps}: {why}. Pin more "
                            f"microbatches (divisors of the batch {batch}) or another schedule")
    core, core_error = None, None
    if 1 in pps and starts is None and microbatches in (None, 1):
        try:
            # the reason is priced only if the error is shown (below): seconds on a deep model
            core = plan_sharding(captured, mesh, ctx.timed(min(30.0, time_limit_s)), explain=False,
                                 pins=pins_for(captured, mesh) if pins_for is not None else None)
        except InfeasiblePlanError as e:
            core_error = e
    core_step = None
    if core is not None:
        core_profile = profile_submesh(captured, core, ctx, units=units)
        core_profile.overlap_grad_sync = pins.overlap_grad_sync
        core_profile.scatter_gather = pins.scatter_gather
        core_profile.blocking_sends = pins.blocking_sends
        core_profile.deepspeed_gathers = pins.deepspeed_gathers
        core_step = single_stage_step(core_profile)
    shallow = shallow_program(captured, units) if fold_blocks else None
    candidates: dict = {}
    search = PipelineSearch(units=shallow.units if shallow else units, blocks=shallow.blocks if shallow else None,
                            deep_chain=True, shapes=pins.shapes, pins_for=pins_for, hints_for=hints_for,
                            quick_s=min(2.0, time_limit_s / 4), thorough_s=min(30.0, time_limit_s / 2),
                            total_s=time_limit_s / 2, schedules=schedules, microbatches=microbatches, starts=starts,
                            recompute=pins.recompute, mixed_precision=pins.mixed_precision)
    profiles = plan_candidates(shallow.captured if shallow else captured, mesh, pps, ctx, search, stats=candidates)
    for profile in profiles.values():
        profile.overlap_grad_sync, profile.scatter_gather = pins.overlap_grad_sync, pins.scatter_gather
        profile.blocking_sends, profile.deepspeed_gathers = pins.blocking_sends, pins.deepspeed_gathers
    # what is left of the WORK limit (deterministic seconds, never the clock: the plan must not
    # depend on the machine's load) after the core plan's and the candidates' solves
    spent = candidates.get("work_s", 0.0) + (core.solver_stats.get("work_s", 0.0) if core is not None else 0.0)
    left = max(1.0, time_limit_s - spent)
    best, stats = search_stages(profiles, mesh, ctx.timed(left), batch, search)
    stats["plan_wall_s"] = round(time.perf_counter() - t0, 3)
    stats["candidates"] = _candidate_stats(candidates)
    if shallow is not None:
        stats["shallow_copy"] = {"blocks": shallow.blocks, "kept": len(shallow.units) - len(units) + shallow.blocks}
    if core is not None and (best is None or core_step <= best.step_time):
        return _core_plan(core, core_step, captured, mesh, stats, ctx.hardware)
    if best is None:
        if core_error is not None:  # the same solve again, now saying what the smallest plan needs
            try:
                plan_sharding(captured, mesh, ctx.timed(min(30.0, time_limit_s)),
                              pins=pins_for(captured, mesh) if pins_for is not None else None)
            except InfeasiblePlanError as e:
                core_error = e
        raise _infeasible(mesh, limit, pps, schedules, microbatches, starts, stats, core_error)
    return _build(best, captured, mesh, stats, shallow, ctx.hardware)


def _candidate_stats(stats: dict) -> dict:
    """``plan_candidates``' statistics as JSON: "pp=16 dp=32 tp=2" -> its row; finalists as such keys."""
    def key(k):
        return f"pp={k[0]} dp={k[1][0]} tp={k[1][1]}"
    out = {k: v for k, v in stats.items() if k not in ("candidates", "finalists")}
    out["candidates"] = {key(k): v for k, v in stats.get("candidates", {}).items()}
    out["finalists"] = [key(k) for k in stats.get("finalists", [])]
    out["not_resolved"] = [key(k) for k in stats.get("not_resolved", [])]
    return out


def virtual_stages(schedule: str) -> int:
    """Stages per rank group of ``schedule`` (the registry's descriptor)."""
    return get_schedule(schedule).virtual_stages


def _schedules(schedule) -> tuple[str, ...]:
    if schedule is None:
        return DEFAULT_SCHEDULES
    names = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    try:
        return tuple(get_schedule(s).name for s in names)
    except ScheduleError as err:
        raise AutoshardError(str(err)) from None


def _resolve_stages(stages, units: list[LayerUnit]) -> Optional[list[int]]:
    if stages is None:
        return None
    first = {u.nodes[0]: i for i, u in enumerate(units)}
    where = {n: (i, u) for i, u in enumerate(units) for n in u.nodes}
    out = []
    for b in stages:
        if isinstance(b, str):
            if b not in where:
                raise AutoshardError(f"stage boundary {b!r} is not a call_function node of the captured graph")
            i, u = where[b]
            if b not in first:
                raise AutoshardError(f"stage boundary {b!r} lies inside layer unit {u.name!r}; stages start at a "
                                     f"unit's first node: use {u.nodes[0]!r} (or the unit index {i})")
            out.append(i)
        else:
            out.append(int(b))
    if out != sorted(set(out)) or (out and (out[0] < 1 or out[-1] > len(units) - 1)):
        raise AutoshardError(f"stage boundaries {list(stages)} must be increasing unit indices in 1..{len(units) - 1} "
                             f"(units: {[u.name for u in units]})")
    return out


def _pp_options(mesh: Mesh, pp, num_units: int, starts, schedules) -> list[int]:
    rows = mesh.shape[0]
    if pp is not None:
        if pp < 1 or rows % pp:
            raise AutoshardError(f"pp={pp} must divide the mesh's first axis: {rows} % {pp} = {rows % pp if pp else '-'}; "
                                 f"choose pp among {[d for d in range(1, rows + 1) if rows % d == 0]}")
        return [pp]
    found = [d for d in range(1, rows + 1) if rows % d == 0 and d <= num_units]
    if starts is not None:
        found = [d for d in found if any(d * virtual_stages(s) == len(starts) + 1 for s in schedules)]
        if not found:
            raise AutoshardError(f"{len(starts) + 1} pinned stages cannot be pp * virtual for any pp dividing the "
                                 f"mesh's first axis ({rows}) and schedules {list(schedules)}")
    return found


def _params_read(captured: CapturedGraph, units: list[LayerUnit]) -> int:
    """How many units read a parameter."""
    params = set(captured.params)
    return sum(1 for u in units if any(a.name in params for n in u.nodes for a in captured.node(n).all_input_nodes))


def _cuttable(captured: CapturedGraph, units: list[LayerUnit], pps: list[int], schedules) -> bool:
    """Whether some (pp, schedule) asked for can be cut from ``units``: ``pp * virtual`` units, ``pp``
    of them reading a parameter (a rank group without one has nothing to train)."""
    with_params = _params_read(captured, units)
    return not pps or any(p == 1 or (p * virtual_stages(s) <= len(units) and (not with_params or p <= with_params))
                          for p in pps for s in schedules)


def _check_stage_counts(captured: CapturedGraph, units: list[LayerUnit], pps: list[int], schedules) -> None:
    """Raise ``StageCutError`` when ``_cuttable`` says no: the cut, not memory, is what fails."""
    if _cuttable(captured, units, pps, schedules):
        return
    with_params = _params_read(captured, units)
    need = min(p * virtual_stages(s) for p in pps for s in schedules)
    asked = ", ".join(f"pp={p} x {virtual_stages(s)} ({s})" for p in pps for s in schedules)
    if any(u.block is not None for u in units):
        how = f"between numbered blocks, into {len(units)} units {[u.name for u in units]}"
    else:
        points = cut_points(captured)
        refused = [c for c in points if c.refused]
        why = f"; refused: {'; '.join(f'before {c.node}: {c.refused}' for c in refused[:3])}" if refused else ""
        how = (f"at op boundaries: {len(points) - len(refused)} of {len(points)} boundaries "
               f"between its {len(points) + 1} ops are valid, giving {len(units)} units {[u.name for u in units][:8]}"
               + why)
    groups = (f"; only {with_params} of the units read a parameter, and each of the {min(pps)} rank groups needs "
              f"one" if with_params and min(pps) > with_params else "")
    raise StageCutError(
        f"no valid stage cut into {need} stages (asked: {asked}): the program can only be cut {how}{groups}. Ask "
        f"for fewer stages (a smaller pp, or a schedule without virtual stages such as '1f1b'), or use a model "
        f"with more ops between which tensors alone cross")


def _infeasible(mesh, limit, pps, schedules, microbatches, starts, stats, core_error) -> InfeasiblePlanError:
    need = stats.get("smallest_memory")
    smallest = f"; the leanest configuration tried needs {human_bytes(need)} on its busiest group" if need else ""
    core = f" The plan without a pipeline failed too: {core_error}" if core_error else ""
    pins = [f"{k}={v}" for k, v in (("microbatches", microbatches), ("stages", starts)) if v is not None]
    return InfeasiblePlanError(
        f"no pipeline plan fits memory_limit={int(limit)} bytes ({human_bytes(limit)}) per device on mesh {mesh.shape} "
        f"with pp in {pps}, schedules {list(schedules)}{smallest}. To relax: raise memory_limit, allow more pipeline "
        f"stages (a mesh with a longer first axis, or pp=None), a lighter optimizer (optimizer='sgd'), a smaller "
        f"batch" + (f", or drop the pins {', '.join(pins)}" if pins else "") + "." +
        (" The search ran out of time_limit_s; raise it." if stats.get("timed_out") else "") +
        (f" The stage ILP ran out of work on {stats['ilp_unknown']} configuration(s) before finding any cut (not a "
         f"proof that none fits); raise time_limit_s." if stats.get("ilp_unknown") else "") + core)


def _plan(stages: list, captured: CapturedGraph, mesh: Mesh, hardware, **fields) -> Plan:
    return Plan(stages, mesh, hardware=hardware_label(hardware), fingerprint=graph_fingerprint(captured),
                captured=captured, work=plan_work(captured, hardware, mesh.size), **fields)


def _core_plan(core: Solution, step: float, captured: CapturedGraph, mesh: Mesh, stats: dict, hardware) -> Plan:
    """No pipeline: one stage, the core plan; its step time with the gradient sync overlapped (the
    core ``Solution`` keeps its own, fully exposed, estimate)."""
    nodes = [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]
    core.solver_stats = dict(core.solver_stats, pipeline_search=stats, overlapped_step_time=step)
    stage = Stage(0, nodes, 0, list(range(mesh.size)), mesh, core)
    return _plan([stage], captured, mesh, hardware, simulated_step_time=step,
                 peak_activation_memory=[core.memory_breakdown.get("activations", 0.0)])


def _build(best: Choice, captured: CapturedGraph, mesh: Mesh, stats: dict,
           shallow: Optional[ShallowProgram], hardware) -> Plan:
    prof, sol = best.profile, best.stages
    units, full = prof.units, prof.solution
    if shallow is not None:  # the profile's units stand for the deep program's, one for one
        if [u.name for u in shallow.deep_units] != [u.name for u in units]:
            raise AssertionError(f"the folded profile's units {[u.name for u in units][:4]}... are not the deep "
                                 f"program's {[u.name for u in shallow.deep_units][:4]}...")
        units = shallow.deep_units
        full = shallow.deep_solution(full) if full is not None else None
    group_size = mesh.size // best.pp
    groups = stage_rank(best.schedule, best.pp, best.virtual)
    plans = []
    for s, rng in enumerate(sol.ranges(len(prof.units))):
        nodes = [n for i in rng for n in units[i].nodes]
        g = groups[s]
        part = _stage_solution(prof, full, rng, nodes, captured, best, s, stats)
        plans.append(Stage(s, nodes, g, list(range(g * group_size, (g + 1) * group_size)), prof.mesh, part,
                           sol.recompute[s]))
    act = [sol.memory[s] - sum(prof.costs[i].state_bytes for i in rng)
           for s, rng in enumerate(sol.ranges(len(prof.units)))]
    return _plan(plans, captured, mesh, hardware, schedule=best.schedule, microbatches=best.m,
                 simulated_step_time=best.step_time, bubble_fraction=best.bubble_fraction, peak_activation_memory=act)


def _stage_solution(prof: SubmeshProfile, full: Optional[Solution], rng: range, nodes: list[str],
                    captured: CapturedGraph, best: Choice, s: int, stats: dict) -> Optional[Solution]:
    """The candidate's intra-op plan ``full`` (of ``captured``) restricted to one stage: its ops, the
    placeholders they read, its costs."""
    if full is None:
        return None
    mine = set(nodes)
    read = {a.name for n in nodes for a in captured.node(n).all_input_nodes if a.op == "placeholder"}
    strategies = {k: v for k, v in full.strategies.items() if k in mine or k in read}
    fqns = {captured.params[n] for n in read if n in captured.params}
    fqns |= {a for a, c in captured.aliases.items() if c in fqns}
    costs = [prof.costs[i] for i in rng]
    mem = {k: sum(getattr(c, k) for c in costs) for k in ("params", "grads", "optimizer")}
    mem["grads"] += sum(c.held_grads for c in costs)  # zero1's unreduced gradients
    mem["activations"] = best.stages.memory[s] - sum(mem.values())
    m = best.m
    times = {"compute+communication": m * best.stages.stage_time[s], "grad_sync": best.stages.stage_sync[s]}
    return Solution(
        mesh=prof.mesh, strategies=strategies,
        param_placements={k: v for k, v in full.param_placements.items() if k in fqns},
        estimated_step_time=sum(times.values()), estimated_memory=best.stages.memory[s], memory_breakdown=mem,
        estimated=memory_record(*best.stages.records[s]) if best.stages.records else {},
        levers=Levers(mixed_precision=full.levers.mixed_precision),  # what the stage's gradients were priced with
        time_breakdown=times, unruled_ops=list(full.unruled_ops),
        redistributions=[r for r in full.redistributions if r.consumer in mine],
        param_grad_syncs={k: v for k, v in full.param_grad_syncs.items() if k in fqns},
        solver_stats=dict(full.solver_stats, pipeline_search=stats, stage=s, recompute=best.stages.recompute[s]))
