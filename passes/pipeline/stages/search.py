"""The search behind ``plan_pipeline``: intra-op plans per (pp, submesh) candidate, then the best
(m, schedule, stage cut, recompute) over them.

``profile_candidates`` solves one intra-op plan per (pp, (dp, tp)) candidate (``plan_submesh``,
whose ILP is capped at ``time_limit_s``; a candidate whose plan cannot fit falls back to the
least-memory plan) and prices it per layer unit. ``plan_candidates`` does that with a short cap
for every candidate, then re-solves only the few that rank best with a longer one: most of the
ILP time goes where the answer is decided.

``search_stages`` ranks every configuration's balanced cut in closed form, simulates the shortlist
(``scoring.score_stages``) and refines the best with the stage ILP (``stage_ilp.solve_stages``).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional, Sequence

from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.microbatch import global_batch
from autoshard.passes.solve.work_budget import WorkBudget
from autoshard.passes.pipeline.stages.candidate_plan import CandidateSpec, plan_submesh
from autoshard.passes.pipeline.stages.layer_costs import SubmeshProfile, layer_units, profile_submesh, submesh_shapes
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.scoring import (DEFAULT_SCHEDULES, Choice, approx_held, config_floor,
                                                       group_moments, held_microbatches, score_stages, stage_problem,
                                                       step_floor, valid_schedule)
from autoshard.passes.pipeline.stages.stage_fit import SHRINK, fitting_profile
from autoshard.passes.pipeline.stages.stage_cuts import balanced_stages, balanced_starts, even_stages, leanest_memory
from autoshard.passes.pipeline.stages.stage_ilp import solve_stages
from autoshard.passes.pipeline.stages.stage_problem import StageProblem, StageSolution
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch

__all__ = ["global_batch", "profile_candidates", "plan_candidates", "closed_form_best", "fit_check", "microbatch_options",
           "search_stages"]



def profile_candidates(captured: CapturedGraph, mesh: Mesh, pps: Sequence[int], ctx: PlanContext,
                       search: PipelineSearch, *, stats: Optional[dict] = None, budget_scale: float = 1.0,
                       memo: Optional[dict] = None) -> dict[tuple[int, tuple[int, int]], SubmeshProfile]:
    """``(pp, (dp, tp)) -> SubmeshProfile`` for every pp > 1 in ``pps`` and every submesh shape of
    its rank groups: the intra-op plan of ``candidate_plan.plan_submesh`` for one sequence per data-
    parallel rank per microbatch and a 1F1B stage's average in-flight count, priced per unit.
    ``ctx``: the hardware, optimizer and memory limit; ``ctx.time_limit_s``: the intra-op ILP's limit per
    candidate. From ``search``:

    ``blocks``: the model's real number of blocks when ``captured`` was traced with fewer (identical
    blocks cost the same); the profiles then stand for the deep model (``repeat_blocks``) and the
    intra-op ILP counts every traced block ``blocks / traced`` times. ``single``: also profile pp = 1
    (one stage on the whole mesh: plain gradient accumulation over m microbatches).
    ``stats``: filled with each candidate's wall time and intra-op status. ``shapes``: only these (dp, tp) shapes (those whose size is
    a rank group's, tp inside a node or not).
    ``deep_chain``: count the ILP edges from one traced block to the next as often as the deep model
    has them, (blocks - 1) / (traced - 1) times; by default they count blocks / traced times, like the
    edges inside a block (the approximation ``profile_candidates(blocks=...)`` has always made: with 2
    traced blocks of 32, 16 block-to-block edges instead of 31). ``plan_pipeline``'s shallow copy sets it.
    A pp > 1 candidate whose plan no balanced cut of ``schedules`` (at ``microbatches``, if pinned)
    fits is planned again, leaner (``stage_fit.fitting_profile``): more memory never leaves a
    candidate with only a plan its stages cannot hold. ``budget_scale``: the intra-op budget is
    ``budget_scale`` x pp x the memory limit (``plan_candidates``' leaner finalists). ``pins_for``:
    the decisions fixed on each candidate's program and submesh (a pinned layout's placements).
    ``hints_for``: known plans' pins on each candidate's program and submesh (the published layouts of
    its shape), which its intra-op solve starts from and never prices worse than (unused with
    ``pins_for``: a pinned candidate has nothing to choose). ``memo``: a dict kept between calls with the
    same ``captured``, ``mesh``, ``ctx`` (but its time limit) and ``search`` (but its shapes): what a
    candidate planned again reuses (``candidate_plan.plan_submesh``'s ``memo``; the same plans)."""
    units = search.units if search.units is not None else layer_units(captured)
    blocks, shapes, pins_for, hints_for = search.blocks, search.shapes, search.pins_for, search.hints_for
    microbatches, memory_limit = search.microbatches, ctx.memory_bytes
    traced = sum(1 for u in units if u.block is not None)
    repeat = blocks / traced if blocks and traced else 1.0
    chain = (blocks - 1) / (traced - 1) if search.deep_chain and blocks and traced > 1 else repeat
    batch = global_batch(captured)
    stats = stats if stats is not None else {}
    out: dict = {}
    for p in pps:
        if p == 1 and not search.single:
            continue  # plan_pipeline prices "no pipeline" with the core plan on the physical mesh
        group = mesh.size // p
        # shapes asked for by name are planned even with tp across nodes (a layout that runs so is priced
        # so); the search's own keep tp inside a node
        for shape in ([tuple(x) for x in shapes if math.prod(x) == group] if shapes is not None
                      else submesh_shapes(group, ctx.spec)):
            t0 = time.perf_counter()
            # a pinned layout (``pins_for``) prices its own microbatch count: its submesh's first axis need not
            # be all of its data parallelism (expert-parallel folding); else one sequence per first-axis rank
            m_ref = (microbatches if pins_for is not None and microbatches else
                     max(1, batch // shape[0]) if batch % shape[0] == 0 else 1)
            work = [0.0]
            mine = (memo if memo is not None else {}).setdefault((p, shape, m_ref), {})
            pins = pins_for(captured, Mesh(shape)) if pins_for is not None else None
            if "hints" not in mine:
                mine["hints"] = hints_for(captured, Mesh(shape)) if hints_for is not None and pins is None else ()
            hints = mine["hints"]

            def plan(budget, shape=shape, m_ref=m_ref, p=p, pins=pins, hints=hints, mine=mine):
                spec = CandidateSpec(m_ref, math.ceil((p + 1) / 2), repeat, chain, search.mixed_precision)
                sol = plan_submesh(captured, Mesh(shape), ctx.limited(budget), spec, pins=pins, hints=hints,
                                   memo=mine.setdefault("plan_submesh", {}))
                work[0] += sol.solver_stats["work_s"]
                prof = profile_submesh(captured, sol, ctx, units=units)
                return sol, prof.repeat_blocks(blocks) if blocks else prof

            def check(prof, p=p):
                return fit_check(prof, p, mesh, ctx, batch, search)

            if p > 1:
                sol, out[(p, shape)], replans = fitting_profile(plan, budget_scale * p * memory_limit, check,
                                                                memory_limit)
            else:
                (sol, out[(p, shape)]), replans = plan(budget_scale * p * memory_limit), []
            stats[(p, shape)] = {"wall_s": round(time.perf_counter() - t0, 3),
                                 "status": sol.solver_stats.get("status"), "work_s": round(work[0], 4)}
            if replans:
                stats[(p, shape)]["replans"] = replans
    return out


def plan_candidates(captured: CapturedGraph, mesh: Mesh, pps: Sequence[int], ctx: PlanContext,
                    search: PipelineSearch, stats: Optional[dict] = None
                    ) -> dict[tuple[int, tuple[int, int]], SubmeshProfile]:
    """``profile_candidates`` in two passes (``search.quick_s``, ``thorough_s``, ``finalists``, ``total_s``;
    ``ctx.time_limit_s`` is not read): every candidate's intra-op ILP capped at ``quick_s``,
    then the ``finalists`` whose quick plans rank best (``closed_form_best``: no simulation, a few ms
    each) solved again for up to ``thorough_s`` when the quick solve was not proven optimal; a
    re-solve replaces the quick plan only if it ranks better. The best-ranked finalist is also planned
    under a budget ``stage_fit.SHRINK`` times tighter (capped at ``quick_s``), kept if it ranks better:
    the proxy budget is looser than the stages' constraint (``stage_fit``), so the plan it picks can
    spend memory the stages then pay for in more microbatches or recompute (one solve, not one per
    finalist: on the 405B it costs 5 deterministic seconds, 2 minutes of wall time on busy cores; ``deep_chain``: as in
    ``profile_candidates``; ``shapes``: only these (dp, tp) submeshes; ``schedules`` / ``microbatches``:
    the ones searched, which rank the candidates and decide whether a plan fits). ``stats``: per-candidate
    wall times and statuses, the finalists, each pass's seconds, and ``work_s``, the deterministic
    seconds all the candidates' solves spent.

    ``total_s``: the work (deterministic seconds) both passes may spend together (None: no bound).
    The first pass always runs (every candidate needs a plan); the re-solves share what it leaves,
    each capped at ``thorough_s``, and a finalist is not re-solved when what is left is no more than
    ``quick_s`` (it would get no more work than it had). Many candidates (Llama 3 405B on (2048, 8):
    28, 37 work-s in the first pass) then leave nothing to re-solve with, which bounds plan time by
    the limit the caller was given instead of by the number of candidates. ``pins_for`` and
    ``hints_for``: as in ``profile_candidates``, for every solve."""
    stats = stats if stats is not None else {}
    quick_s, thorough_s, total_s, memory_limit = search.quick_s, search.thorough_s, search.total_s, ctx.memory_bytes
    t0 = time.perf_counter()
    per: dict = {}
    memo: dict = {}  # a candidate planned again (re-solved, leaner) reuses its problem, graphs and hint solves
    profiles = profile_candidates(captured, mesh, pps, ctx.timed(quick_s), search, stats=per, memo=memo)
    batch = global_batch(captured)
    t1 = time.perf_counter()

    def searched(key, prof):
        return fit_check(prof, key[0], mesh, ctx, batch, search)[0]

    score = {key: searched(key, prof) for key, prof in profiles.items()}
    t2 = time.perf_counter()
    chosen = sorted((k for k in score if score[k] < math.inf), key=score.get)[:search.finalists]
    left = math.inf if total_s is None else total_s - sum(row["work_s"] for row in per.values())
    skipped = []
    for key in chosen:
        if str(per[key]["status"]).startswith("OPTIMAL"):
            continue
        limit = min(thorough_s, left)
        if limit <= quick_s:
            skipped.append(key)
            continue
        again: dict = {}
        better = profile_candidates(captured, mesh, [key[0]], ctx.timed(limit), replace(search, shapes=[key[1]]),
                                    stats=again, memo=memo)
        left -= again[key]["work_s"]
        step = searched(key, better[key])
        per[key] = dict(again[key], quick=per[key], quick_step=score[key], step=step)
        if step < score[key]:
            profiles[key], score[key] = better[key], step
    for key in chosen[:1]:  # the proxy budget is looser than the stages' constraint: try a leaner plan too
        scale = SHRINK
        if any(row["budget"] == round(scale * key[0] * memory_limit) for row in per[key].get("replans", ())):
            continue  # the re-plan loop solved that budget already
        lean: dict = {}
        leaner = profile_candidates(captured, mesh, [key[0]], ctx.timed(quick_s), replace(search, shapes=[key[1]]),
                                    stats=lean, budget_scale=scale, memo=memo)
        step = searched(key, leaner[key])
        per[key] = dict(per[key], leaner=dict(lean[key], budget_scale=round(scale, 4), step=step))
        if step < score[key]:
            profiles[key], score[key] = leaner[key], step
    work = sum(row["work_s"] + row.get("quick", {}).get("work_s", 0.0) + row.get("leaner", {}).get("work_s", 0.0)
               for row in per.values())
    stats.update(candidates=per, finalists=chosen, quick_s=round(t1 - t0, 3), rank_s=round(t2 - t1, 3),
                 thorough_s=round(time.perf_counter() - t2, 3), work_s=round(work, 4), not_resolved=skipped)
    return profiles


def closed_form_best(prof: SubmeshProfile, p: int, mesh: Mesh, ctx: PlanContext, batch: int,
                     schedules: Sequence[str] = DEFAULT_SCHEDULES) -> float:
    """The smallest closed-form step time (``stage_problem.pipeline_step_time`` of the balanced cut, in-
    flight counts from ``approx_held``) over microbatch counts and ``schedules``; inf if none fits.
    A ranking, not a simulation: it prices every configuration in microseconds."""
    return fit_check(prof, p, mesh, ctx, batch, PipelineSearch(schedules=tuple(schedules)))[0]


def fit_check(prof: SubmeshProfile, p: int, mesh: Mesh, ctx: PlanContext, batch: int,
              search: PipelineSearch) -> tuple[float, float]:
    """(the smallest closed-form step of a balanced cut that fits ``ctx``'s memory limit, inf if none;
    the least busiest-group memory of the balanced cuts, each stage recomputing where that is leaner)
    over ``search.schedules`` and the microbatch counts searched (``search.microbatches``: only that
    one). The pinned cut and recompute of ``search`` are not applied (a candidate's ranking)."""
    best, need = math.inf, math.inf
    microbatches = search.microbatches
    for schedule in search.schedules:
        if p * get_schedule(schedule).virtual_stages > len(prof.units):
            continue
        for m in microbatch_options(batch, prof.batch_shard, p, microbatches):
            if not valid_schedule(schedule, p, m):
                continue
            prob = stage_problem(prof, (p, m, schedule), mesh, ctx, approx_held(schedule, p, m))
            sol = balanced_stages(prob)
            if sol is not None:
                best = min(best, sol.step_time)
            need = min(need, leanest_memory(prob, balanced_starts(prob)))
    return best, need


def microbatch_options(batch: int, shard: int, p: int, pinned: Optional[int] = None) -> list[int]:
    """Microbatch counts searched: every divisor m of the batch whose microbatch still divides over
    the intra-op plan's batch sharding (or the pinned one). Bubbles shrink with m while per-
    microbatch costs (launches, latencies, weight gathers) grow, so neither end is always best."""
    if pinned is not None:
        return [pinned] if batch % pinned == 0 and (batch // pinned) % shard == 0 else []
    return [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % shard == 0]


#: phase 3 simulates an even cut whose closed-form step is below this multiple of the best so far
EVEN_CUT_MARGIN = 1.3


def search_stages(profiles: dict, mesh: Mesh, ctx: PlanContext, batch: int, search: PipelineSearch = PipelineSearch(),
                  *, refine: int = 4, shortlist: int = 4) -> tuple[Optional[Choice], dict]:
    """The best ``Choice`` over ``profiles`` (from ``profile_candidates`` or ``repeat_blocks``) x
    microbatch counts x ``search.schedules`` (None if nothing fits), and search statistics, under
    ``ctx``'s memory limit; ``search.microbatches``, ``starts`` and ``recompute``: pinned when not None.

    Phase 1 prices every configuration's balanced cut (``stage_cuts.balanced_stages``) in closed form
    (activations in flight from the 1F1B / GPipe / interleaved formulas); the ``shortlist`` best of
    every schedule family (``Schedule.ranking_family``: interleaved 1F1B's v's share one) are then
    re-cut with the simulator's in-flight counts and simulated, skipping those whose bound
    m * work / pp (no bubble, no communication) cannot beat the best so far.
    Phase 2 runs the stage ILP on the ``refine`` best simulated ones, and on configurations the
    balanced cut could not fit (the ``refine`` with the smallest bounds that can still win and that the
    memory lower bound does not prove unfit: a proof costs no ILP, so it takes no place).
    Phase 3 (unpinned cuts) simulates the even cut of every configuration whose bound can still
    win, recompute on all stages or none (``_even_cuts``).

    ``ctx.time_limit_s`` bounds the stage ILP solves together as a WORK limit (CP-SAT deterministic
    seconds, each solve at most 2), never the clock: the same profiles give the same choice however
    busy the machine is. The closed-form and simulation phases are bounded by the configurations
    themselves. ``stats["work_s"]``: the deterministic seconds spent."""
    t0 = time.perf_counter()
    budget = WorkBudget(ctx.time_limit_s)
    schedules, microbatches, starts = search.schedules, search.microbatches, search.starts
    memory_limit = ctx.memory_bytes
    configs = []
    for (p, shape), prof in profiles.items():
        for schedule in schedules:
            v = get_schedule(schedule).virtual_stages
            if p * v > len(prof.units) or (starts is not None and len(starts) + 1 != p * v):
                continue
            for m in microbatch_options(batch, prof.batch_shard, p, microbatches):
                if valid_schedule(schedule, p, m):
                    work = sum(c.fwd(m) + c.bwd(m) for c in prof.costs)
                    # the busiest group's compute (the order searched), and the floor with the optimizer step
                    configs.append((m * work / p, p, prof, m, schedule, config_floor(prof.costs, p, m)))
    configs.sort(key=lambda c: c[0])
    stats = {"configs": len(configs), "heuristic": 0, "simulated": 0, "ilp": 0, "smallest_memory": None}
    ranked: dict[str, list] = {}
    unfit: list[tuple[float, StageProblem, tuple, float]] = []
    for bound, p, prof, m, schedule, floor in configs:
        state = sum(c.state_bytes for c in prof.costs) / p
        if state > memory_limit:
            _note_memory(stats, state)
            continue
        prob = stage_problem(prof, (p, m, schedule), mesh, ctx, approx_held(schedule, p, m), search)
        stats["heuristic"] += 1
        sol = balanced_stages(prob)
        if sol is None:
            _note_memory(stats, leanest_memory(prob, balanced_starts(prob)))
            unfit.append((bound, prob, (p, prof, m, schedule), floor))
        else:
            ranked.setdefault(get_schedule(schedule).ranking_family, []).append(
                (sol.step_time, bound, p, prof, m, schedule, floor))
    scored: list[tuple[float, int, Choice, StageProblem]] = []
    best: Optional[Choice] = None
    for rows in ranked.values():  # the closed form ranks configurations of one schedule family alike
        for _, bound, p, prof, m, schedule, floor in sorted(rows, key=lambda r: r[0])[:shortlist]:
            if _below(best, bound, floor):
                continue
            held = list(held_microbatches(schedule, p, m))
            prob = stage_problem(prof, (p, m, schedule), mesh, ctx, held, search, group_moments(schedule, p, m))
            sol = balanced_stages(prob)
            if sol is None:
                unfit.append((bound, prob, (p, prof, m, schedule), floor))
                continue
            stats["simulated"] += 1
            choice = _choice(prob, sol, p, prof, m, schedule, held)
            scored.append((choice.step_time, len(scored), choice, prob))
            if best is None or choice.step_time < best.step_time:
                best = choice
    unfit.sort(key=lambda u: u[0])
    scored.sort(key=lambda c: (c[0], c[1]))
    todo = [(c.step_time, prob, (c.pp, c.profile, c.m, c.schedule), c.stages, 0.0) for _, _, c, prob in scored[:refine]]
    todo += [(bound, prob, key, None, floor) for bound, prob, key, floor in unfit]
    unfit_solves = 0  # the ILP runs on at most ``refine`` unfit configurations; those proven unfit cost none
    for bound, prob, (p, prof, m, schedule), hint, floor in todo:
        left = budget.left()
        if left <= 0:
            stats["timed_out"] = True
            break
        if hint is None and (unfit_solves >= refine or _below(best, bound, floor)):
            continue
        if hint is None:
            prob = StageProblem(**{**prob.__dict__, "held": list(held_microbatches(schedule, p, m)),
                                   "moments": group_moments(schedule, p, m)})
            if prob.memory_lower_bound() > memory_limit:  # no cut fits: proven without the ILP
                stats["proven_unfit"] = stats.get("proven_unfit", 0) + 1
                continue
            unfit_solves += 1
        outcome: dict = {}
        sol = solve_stages(prob, time_limit_s=min(2.0, left), hint=hint, budget=budget, outcome=outcome)
        stats["ilp"] += 1
        if sol is None:
            if outcome.get("status") == "UNKNOWN":  # out of work before any cut: not a proof that none fits
                stats["ilp_unknown"] = stats.get("ilp_unknown", 0) + 1
            continue
        choice = _choice(prob, sol, p, prof, m, schedule, prob.held)
        if best is None or choice.step_time < best.step_time:
            best = choice
    if starts is None:
        best = _even_cuts(configs, best, stats, mesh, ctx, search.recompute, budget)
    stats["wall_s"] = round(time.perf_counter() - t0, 3)
    stats["work_s"] = round(budget.spent, 4)
    return best, stats


def _even_cuts(configs: list, best: Optional[Choice], stats: dict, mesh: Mesh, ctx: PlanContext,
               recompute: Optional[bool], budget: WorkBudget, margin: float = EVEN_CUT_MARGIN) -> Optional[Choice]:
    """Every configuration whose bound can still win, cut evenly by unit count with recompute on
    all stages or none, simulated when its closed form is within ``margin`` of the best so far: the
    closed form ranks one schedule against itself well but can misjudge across schedules (zbv's V
    against 1F1B), and this pass keeps such a miss from hiding a textbook layout that beats the answer.
    The stage ILP then refines every even cut that was the best when simulated (the winner first, then
    the earlier ones while their floor can still win: a slower even cut can refine to a faster plan, e.g.
    v 4 with an uneven cut and some recompute against v 8 cut one unit per stage; a few solves, since each
    had to beat the one before), spending from ``budget`` (deterministic work)."""
    stats["even"] = 0
    improved: list[tuple[Choice, StageProblem, float, float]] = []
    for bound, p, prof, m, schedule, floor in configs:  # sorted by bound
        if best is not None and bound >= best.step_time:
            break
        if _below(best, bound, floor):
            continue
        unpinned = PipelineSearch(recompute=recompute)  # an even cut: no pinned starts
        rough = stage_problem(prof, (p, m, schedule), mesh, ctx, approx_held(schedule, p, m), unpinned)
        for on in ((False, True) if recompute is None else (bool(recompute),)):
            # the closed form's step decides whether to simulate; its memory does not: without the schedule's
            # moments it sums each stage's own worst count, above what a group of several stages holds at once
            guess = even_stages(rough, on, check_memory=get_schedule(schedule).virtual_stages == 1)
            if guess is None or (best is not None and guess.step_time >= margin * best.step_time):
                continue
            # the floor reads no held count: the even cut priced with the schedule's exact ones below has
            # the same starts and the same floor, so what cannot win is dropped before its counts are built
            if _cannot_beat(rough, schedule, guess, best):
                continue
            held = list(held_microbatches(schedule, p, m))
            prob = stage_problem(prof, (p, m, schedule), mesh, ctx, held, unpinned, group_moments(schedule, p, m))
            sol = even_stages(prob, on)
            if sol is None or _cannot_beat(prob, schedule, sol, best):
                continue
            stats["even"] += 1
            choice = _choice(prob, sol, p, prof, m, schedule, held)
            if best is None or choice.step_time < best.step_time:
                best = choice
                improved.append((choice, prob, bound, floor))
    for even, prob, bound, floor in reversed(improved):  # the stage ILP refines the winner, then the runners-up
        left = budget.left()
        if left <= 0:
            break
        if even is not best and _below(best, bound, floor):
            continue
        sol = solve_stages(prob, time_limit_s=min(2.0, left), hint=even.stages, budget=budget)
        stats["ilp"] += 1
        if sol is not None:
            choice = _choice(prob, sol, even.pp, even.profile, even.m, even.schedule, prob.held)
            if choice.step_time < best.step_time:
                best = choice
    return best


def _cannot_beat(prob: StageProblem, schedule: str, sol: StageSolution, best: Optional[Choice]) -> bool:
    """No simulation of ``sol`` can give a step shorter than ``best``'s: some rank group's wait for its
    first input, compute, and optimizer step or backward tail below it (``scoring.step_floor``, a lower
    bound on the simulated step) are longer, beyond rounding. Skipping it leaves the search's answer as it was (only a strictly shorter step replaces
    the best) and saves the schedule's generation and simulation (tenths of a second each at m ~ 100)."""
    if best is None:
        return False
    return step_floor(prob, schedule, sol.starts, sol.recompute) > best.step_time * (1 + BOUND_TOLERANCE)


def _below(best: Optional[Choice], bound: float, floor: float) -> bool:
    """No cut of a configuration can beat ``best``: its busiest group's compute ``bound`` reaches the best
    step, or its floor with the optimizer step (``scoring.config_floor``) exceeds it beyond rounding."""
    return best is not None and (bound >= best.step_time or floor > best.step_time * (1 + BOUND_TOLERANCE))


#: relative slack on ``_cannot_beat``'s bound: the simulator and the bound add the same durations in
#: different orders (rounding differs by ~1e-15 relative); far below any step-time difference that matters
BOUND_TOLERANCE = 1e-9


def _choice(prob: StageProblem, sol: StageSolution, p: int, prof: SubmeshProfile, m: int, schedule: str,
            held: list[int]) -> Choice:
    step, bubble = score_stages(prob, schedule, sol.starts, sol.recompute)
    return Choice(p, prof, m, schedule, sol, step, bubble, list(held))


def _note_memory(stats: dict, need: Optional[float]) -> None:
    """Keep the least busiest-group memory any configuration needs (for the infeasible message)."""
    if need is None:
        return
    if stats["smallest_memory"] is None or need < stats["smallest_memory"]:
        stats["smallest_memory"] = need
