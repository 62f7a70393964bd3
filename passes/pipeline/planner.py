"""Automatic 3D parallelism: pipeline stages, submesh shapes, microbatches, schedule and recompute,
chosen jointly with the intra-op (data / tensor / FSDP) plan of every stage.

>>> plan = plan_pipeline(captured, (2, 8), hardware=slow_network)       # doctest: +SKIP
>>> plan.pp, plan.stages[0].mesh.shape, plan.schedule, plan.microbatches  # doctest: +SKIP
(2, (8, 1), 'zb-h1', 64)

The search (Alpa's decomposition, Zheng et al. 2022, with CP-SAT for the inter-op part):

1. Layer units (``layer_costs.layer_units``): the program as a chain (embedding, blocks, head).
2. Candidate configurations: ``pp`` divides the physical mesh's first axis (rank group g owns the
   contiguous block of ranks g*G .. (g+1)*G-1, G = world / pp); each group runs a logical (dp, tp)
   submesh with tp inside one node (``layer_costs.submesh_shapes``); the pipeline hop between
   groups uses the first axis's link (``Hardware.axis_link``: the NIC across nodes, NVLink within).
3. Intra-op plan per (pp, submesh shape): the core ILP on the whole program priced per microbatch,
   with activations held as a 1F1B stage holds them, under pp x the memory limit
   (``layer_costs.plan_submesh``); then priced per unit (``layer_costs.profile_submesh``).
   Identical blocks share costs and decisions.
4. Per (pp, shape, microbatches m, schedule): ``stage_ilp.solve_stages`` picks the contiguous unit
   ranges and per-stage recompute minimizing the closed-form step time under the memory limit, with
   the activations the schedule keeps in flight (the simulator's peak per stage). Every
   configuration first gets the balanced cut (``stage_ilp.balanced_stages``); the ILP refines the
   best few and those the balanced cut cannot fit (``search_stages``).
5. Every answer is re-timed by the schedule simulator (``simulate.simulate`` on
   ``generators.generate``); the plan with the smallest SIMULATED step time (+ the slowest group's
   gradient all-reduce) wins, and that is the plan's ``estimated_step_time``. Configurations whose
   bound m * work / pp already exceeds the best are skipped. ``pp = 1`` is the core plan on the
   whole mesh, unchanged.

Pins: ``pp``, ``schedule``, ``microbatches``, ``stages`` (the first unit of every stage after the
first, as unit indices or node names; its length + 1 is the number of stages). Nothing fits ->
``InfeasiblePlanError`` saying what to relax.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ..errors import AutoshardError, InfeasiblePlanError
from ..graph import CapturedGraph
from ..hardware import Hardware, get_hardware
from ..mesh import Mesh
from ..planner import human_bytes, plan_sharding
from ..solution import Solution
from .generators import generate, stage_rank
from .layer_costs import LayerUnit, SubmeshProfile, layer_units, plan_submesh, profile_submesh, submesh_shapes
from .simulate import StageCosts, simulate
from .stage_ilp import StageProblem, StageSolution, balanced_stages, solve_stages, stage_costs
from .stage_plan import SCHEDULES, PipelinePlan, StagePlan

__all__ = ["plan_pipeline", "profile_candidates", "search_stages", "score_stages", "stage_problem",
           "held_microbatches", "microbatch_options", "Choice", "global_batch", "DEFAULT_SCHEDULES", "VIRTUAL"]

#: schedules searched unless pinned (GPipe is 1F1B's time with more memory; DualPipeV's overlap is
#: not modelled by the simulator)
DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
VIRTUAL = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}
_SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules that run B and W apart
_UNBOUNDED = 1e30


@dataclass
class Choice:
    """One scored configuration: pp groups, the submesh profile, m, schedule, the stage cut and its
    simulated step time (seconds, gradient all-reduce included), bubble and per-stage memory."""
    pp: int
    profile: SubmeshProfile
    m: int
    schedule: str
    stages: StageSolution
    step_time: float
    bubble_fraction: float
    held: list[int] = field(default_factory=list)

    @property
    def virtual(self) -> int:
        return VIRTUAL[self.schedule]

    def describe(self) -> str:
        sizes = [len(r) for r in self.stages.ranges(len(self.profile.units))]
        dp, tp = self.profile.mesh.shape
        return (f"pp={self.pp} dp={dp} tp={tp} m={self.m} {self.schedule} units/stage={sizes} "
                f"recompute={sum(self.stages.recompute)}/{len(sizes)} step={self.step_time:.4g}s")


def global_batch(captured: CapturedGraph) -> int:
    """Dim 0 of the first user input (the dimension microbatches cut)."""
    for name in captured.inputs:
        meta = captured.node(name).meta.get("autoshard.meta")
        if meta is not None and getattr(meta, "shape", None):
            return int(meta.shape[0])
    raise AutoshardError("pipeline planning needs a batched tensor input (microbatches cut dim 0 of the inputs)")


# ---- schedule facts (from the simulator) ----------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def held_microbatches(schedule: str, p: int, m: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once under ``schedule``
    (the simulator's ``peak_stage``; a pure function of the schedule, so memoized)."""
    return tuple(simulate(generate(schedule, p, m, VIRTUAL[schedule])).peak_stage)


def _valid(schedule: str, p: int, m: int) -> bool:
    if schedule == "interleaved-1f1b":
        return m % p == 0
    if schedule == "dualpipev":
        return m >= 2 * p
    return True


def stage_problem(profile: SubmeshProfile, p: int, m: int, schedule: str, mesh: Mesh, hw: Hardware,
             memory_limit: float, held: list[int], starts=None, recompute=None) -> StageProblem:
    """The ``StageProblem`` of one configuration: ``profile`` at m microbatches, groups of ``schedule``,
    the pipeline hop priced on the link of the mesh's first axis."""
    costs = profile.costs
    bw, lat = hw.axis_link(Mesh((p, mesh.size // p)), 0)
    cut_bytes = profile.cut_bytes(m)
    return StageProblem(
        fwd=[c.fwd(m) for c in costs], bwd=[c.bwd(m) for c in costs], grad_sync=[c.grad_sync for c in costs],
        state=[c.state_bytes for c in costs], act=[c.act(m) for c in costs],
        cut_seconds=[x / bw + lat if x > 0 else 0.0 for x in cut_bytes], cut_bytes=cut_bytes,
        stage_group=stage_rank(schedule, p, VIRTUAL[schedule]), held=held, m=m, memory_limit=memory_limit,
        recompute=recompute, starts=starts)


def score_stages(prob: StageProblem, schedule: str, starts: Sequence[int], recompute: Sequence[bool]
                 ) -> tuple[float, float]:
    """(simulated step time + slowest group's gradient all-reduce, bubble fraction) of one cut.

    Stage s's forward is its units' forward plus receiving its input; its backward, its units'
    backward, the recomputed forward and receiving its output's gradient (split half input-grad B,
    half weight-grad W for the zero-bubble schedules)."""
    L = len(prob.fwd)
    ends = list(starts[1:]) + [L]
    f, b = [], []
    for s, (a, e) in enumerate(zip(starts, ends)):
        fwd = sum(prob.fwd[a:e])
        f.append(fwd + (prob.cut_seconds[a - 1] if a > 0 else 0.0))
        b.append(sum(prob.bwd[a:e]) + (fwd if recompute[s] else 0.0) + (prob.cut_seconds[e - 1] if e < L else 0.0))
    if schedule in _SPLIT_BACKWARD:
        costs = StageCosts(f=f, b=[x / 2 for x in b], w=[x / 2 for x in b])
    else:
        costs = StageCosts(f=f, b=b, w=[0.0] * len(b))
    result = simulate(generate(schedule, prob.p, prob.m, VIRTUAL[schedule]), costs)
    _, syncs, _ = stage_costs(prob, starts, recompute)
    groups: dict[int, float] = {}
    for s, g in enumerate(prob.stage_group):
        groups[g] = groups.get(g, 0.0) + syncs[s]
    return result.step_time + max(groups.values()), result.bubble_fraction


def profile_candidates(captured: CapturedGraph, mesh: Mesh, pps: Sequence[int], *, hardware: Hardware,
                       optimizer, memory_limit: float, units: Optional[list[LayerUnit]] = None,
                       blocks: Optional[int] = None, single: bool = False,
                       time_limit_s: float = 30.0) -> dict[tuple[int, tuple[int, int]], SubmeshProfile]:
    """``(pp, (dp, tp)) -> SubmeshProfile`` for every pp > 1 in ``pps`` and every submesh shape of
    its rank groups: the intra-op plan of ``layer_costs.plan_submesh`` for one sequence per data-
    parallel rank per microbatch and a 1F1B stage's average in-flight count, priced per unit.

    ``blocks``: the model's real number of blocks when ``captured`` was traced with fewer (identical
    blocks cost the same); the profiles then stand for the deep model (``repeat_blocks``) and the
    intra-op ILP counts every traced block ``blocks / traced`` times. ``single``: also profile pp = 1
    (one stage on the whole mesh: plain gradient accumulation over m microbatches)."""
    units = units if units is not None else layer_units(captured)
    traced = sum(1 for u in units if u.block is not None)
    repeat = blocks / traced if blocks and traced else 1.0
    batch = global_batch(captured)
    out = {}
    for p in pps:
        if p == 1 and not single:
            continue  # plan_pipeline prices "no pipeline" with the core plan on the physical mesh
        for shape in submesh_shapes(mesh.size // p, hardware):
            m_ref = max(1, batch // shape[0]) if batch % shape[0] == 0 else 1
            sol = plan_submesh(captured, Mesh(shape), hardware=hardware, optimizer=optimizer, microbatches=m_ref,
                               held=math.ceil((p + 1) / 2), memory_limit=p * memory_limit, repeat=repeat,
                               time_limit_s=time_limit_s)
            prof = profile_submesh(captured, sol, hardware=hardware, optimizer=optimizer, units=units)
            out[(p, shape)] = prof.repeat_blocks(blocks) if blocks else prof
    return out


def microbatch_options(batch: int, shard: int, p: int, pinned: Optional[int] = None) -> list[int]:
    """Microbatch counts searched: every divisor m of the batch whose microbatch still divides over
    the intra-op plan's batch sharding (or the pinned one). Bubbles shrink with m while per-
    microbatch costs (launches, latencies, weight gathers) grow, so neither end is always best."""
    if pinned is not None:
        return [pinned] if batch % pinned == 0 and (batch // pinned) % shard == 0 else []
    return [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % shard == 0]


def search_stages(profiles: dict, mesh: Mesh, *, hardware: Hardware, memory_limit: float, batch: int,
                  schedules: Sequence[str] = DEFAULT_SCHEDULES, microbatches: Optional[int] = None,
                  starts: Optional[list[int]] = None, recompute: Optional[bool] = None,
                  time_limit_s: float = 60.0, refine: int = 6, shortlist: int = 8) -> tuple[Optional[Choice], dict]:
    """The best ``Choice`` over ``profiles`` (from ``profile_candidates`` or ``repeat_blocks``) x
    microbatch counts x ``schedules`` (None if nothing fits), and search statistics.

    Phase 1 prices every configuration's balanced cut (``stage_ilp.balanced_stages``) in closed form
    (activations in flight from the 1F1B / GPipe / interleaved formulas); the ``shortlist`` best of
    every schedule are then re-cut with the simulator's in-flight counts and simulated. Phase 2 runs
    the stage ILP on the ``refine`` best simulated ones, and on configurations the balanced cut could
    not fit (the ``refine`` with the smallest bounds, while they can still win)."""
    t0 = time.perf_counter()
    configs = []
    for (p, shape), prof in profiles.items():
        for schedule in schedules:
            v = VIRTUAL[schedule]
            if p * v > len(prof.units) or (starts is not None and len(starts) + 1 != p * v):
                continue
            for m in microbatch_options(batch, prof.batch_shard, p, microbatches):
                if _valid(schedule, p, m):
                    work = sum(c.fwd(m) + c.bwd(m) for c in prof.costs)
                    bound = (m * work + sum(c.grad_sync for c in prof.costs)) / p  # the busiest group's busy time
                    configs.append((bound, p, prof, m, schedule))
    configs.sort(key=lambda c: c[0])
    stats = {"configs": len(configs), "heuristic": 0, "simulated": 0, "ilp": 0, "smallest_memory": None}
    ranked: dict[str, list] = {}
    unfit: list[tuple[float, StageProblem, tuple]] = []
    for bound, p, prof, m, schedule in configs:
        if sum(c.state_bytes for c in prof.costs) / p > memory_limit:
            _note_memory(stats, sum(c.state_bytes for c in prof.costs) / p)
            continue
        held = _approx_held(schedule, p, m)
        prob = stage_problem(prof, p, m, schedule, mesh, hardware, memory_limit, held, starts, recompute)
        stats["heuristic"] += 1
        sol = balanced_stages(prob)
        if sol is None:
            unfit.append((bound, prob, (p, prof, m, schedule)))
        else:
            ranked.setdefault(schedule, []).append((sol.step_time, bound, p, prof, m, schedule))
    scored: list[tuple[float, int, Choice, StageProblem]] = []
    best: Optional[Choice] = None
    for rows in ranked.values():  # the closed form ranks configurations of one schedule alike
        for _, bound, p, prof, m, schedule in sorted(rows, key=lambda r: r[0])[:shortlist]:
            if best is not None and bound >= best.step_time:
                continue
            held = list(held_microbatches(schedule, p, m))
            prob = stage_problem(prof, p, m, schedule, mesh, hardware, memory_limit, held, starts, recompute)
            sol = balanced_stages(prob)
            if sol is None:
                unfit.append((bound, prob, (p, prof, m, schedule)))
                continue
            stats["simulated"] += 1
            choice = _choice(prob, sol, p, prof, m, schedule, held)
            scored.append((choice.step_time, len(scored), choice, prob))
            if best is None or choice.step_time < best.step_time:
                best = choice
    unfit.sort(key=lambda u: u[0])
    scored.sort(key=lambda c: (c[0], c[1]))
    todo = [(c.step_time, prob, (c.pp, c.profile, c.m, c.schedule), c.stages) for _, _, c, prob in scored[:refine]]
    todo += [(bound, prob, key, None) for bound, prob, key in unfit[:refine]]
    for bound, prob, (p, prof, m, schedule), hint in todo:
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            stats["timed_out"] = True
            break
        if hint is None and best is not None and prob.lower_bound() >= best.step_time:
            continue
        if hint is None:
            prob = StageProblem(**{**prob.__dict__, "held": list(held_microbatches(schedule, p, m))})
        sol = solve_stages(prob, time_limit_s=min(5.0, left), hint=hint)
        stats["ilp"] += 1
        if sol is None:
            if hint is None and recompute is not False:
                relaxed = balanced_stages(StageProblem(**{**prob.__dict__, "memory_limit": _UNBOUNDED,
                                                          "recompute": True}))
                if relaxed is not None:
                    _note_memory(stats, max(relaxed.memory))
            continue
        choice = _choice(prob, sol, p, prof, m, schedule, prob.held)
        if best is None or choice.step_time < best.step_time:
            best = choice
    stats["wall_s"] = round(time.perf_counter() - t0, 3)
    return best, stats


def _approx_held(schedule: str, p: int, m: int) -> list[int]:
    """In-flight microbatches per stage from closed forms (the simulator's count is exact)."""
    groups = stage_rank(schedule, p, VIRTUAL[schedule])
    if schedule == "gpipe":
        return [m] * len(groups)
    if schedule == "interleaved-1f1b":  # Megatron's warm-up 2 (p - g - 1) + (v - 1) p, plus one, over v
        v = VIRTUAL[schedule]
        return [math.ceil(min(m * v, 2 * (p - g - 1) + (v - 1) * p + 1) / v) for g in groups]
    if schedule in ("zbv", "dualpipev"):
        return [min(m, 2 * (p - g)) for g in groups]
    return [min(m, p - g) for g in groups]


def _choice(prob: StageProblem, sol: StageSolution, p: int, prof: SubmeshProfile, m: int, schedule: str,
            held: list[int]) -> Choice:
    step, bubble = score_stages(prob, schedule, sol.starts, sol.recompute)
    return Choice(p, prof, m, schedule, sol, step, bubble, list(held))


def _note_memory(stats: dict, need: float) -> None:
    if stats["smallest_memory"] is None or need < stats["smallest_memory"]:
        stats["smallest_memory"] = need


# ---- the front door --------------------------------------------------------------------------
def plan_pipeline(captured: CapturedGraph, mesh, *, hardware: Union[str, Hardware] = "h100",
                  memory_limit: Optional[float] = None, optimizer: Union[str, float] = "adamw",
                  pp: Optional[int] = None, schedule: Optional[str] = None, microbatches: Optional[int] = None,
                  stages: Optional[Sequence[Union[int, str]]] = None, time_limit_s: float = 60.0) -> PipelinePlan:
    """The fastest pipeline plan (simulated step time) that fits ``memory_limit`` bytes per device;
    ``pp == 1`` means "no pipeline": the core plan on the whole mesh (``stages[0].solution``)."""
    t0 = time.perf_counter()
    mesh = Mesh.of(mesh)
    hw = get_hardware(hardware)
    limit = float(memory_limit) if memory_limit is not None else hw.memory_bytes
    units = layer_units(captured)
    schedules = _schedules(schedule)
    starts = _resolve_stages(stages, units)
    pps = _pp_options(mesh, pp, len(units), starts, schedules)
    batch = global_batch(captured)
    if microbatches is not None and (microbatches < 1 or batch % microbatches):
        raise AutoshardError(f"microbatches={microbatches} does not divide the global batch {batch}; use a divisor "
                             f"of {batch}")
    core, core_error = None, None
    if 1 in pps and starts is None and microbatches in (None, 1):
        try:
            core = plan_sharding(captured, mesh, hardware=hw, memory_limit=limit, optimizer=optimizer,
                                 time_limit_s=min(30.0, time_limit_s))
        except InfeasiblePlanError as e:
            core_error = e
    profiles = profile_candidates(captured, mesh, pps, hardware=hw, optimizer=optimizer, memory_limit=limit,
                                  units=units, time_limit_s=min(30.0, time_limit_s))
    left = max(1.0, time_limit_s - (time.perf_counter() - t0))
    best, stats = search_stages(profiles, mesh, hardware=hw, memory_limit=limit, batch=batch, schedules=schedules,
                                microbatches=microbatches, starts=starts, time_limit_s=left)
    stats["plan_wall_s"] = round(time.perf_counter() - t0, 3)
    if core is not None and (best is None or core.estimated_step_time <= best.step_time):
        return _core_plan(core, captured, mesh, stats)
    if best is None:
        raise _infeasible(mesh, limit, pps, schedules, microbatches, starts, stats, core_error)
    return _build(best, captured, mesh, stats)


def _schedules(schedule) -> tuple[str, ...]:
    if schedule is None:
        return DEFAULT_SCHEDULES
    names = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    bad = [s for s in names if s not in SCHEDULES]
    if bad:
        raise AutoshardError(f"unknown schedule(s) {bad}; schedules are {SCHEDULES}")
    return names


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
        found = [d for d in found if any(d * VIRTUAL[s] == len(starts) + 1 for s in schedules)]
        if not found:
            raise AutoshardError(f"{len(starts) + 1} pinned stages cannot be pp * virtual for any pp dividing the "
                                 f"mesh's first axis ({rows}) and schedules {list(schedules)}")
    return found


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
        (" The search ran out of time_limit_s; raise it." if stats.get("timed_out") else "") + core)


def _core_plan(core: Solution, captured: CapturedGraph, mesh: Mesh, stats: dict) -> PipelinePlan:
    nodes = [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]
    core.solver_stats = dict(core.solver_stats, pipeline_search=stats)
    stage = StagePlan(0, nodes, 0, list(range(mesh.size)), mesh, core)
    return PipelinePlan(1, 1, [stage], "1f1b", 1, core.estimated_step_time, 0.0,
                        [core.memory_breakdown.get("activations", 0.0)])


def _build(best: Choice, captured: CapturedGraph, mesh: Mesh, stats: dict) -> PipelinePlan:
    prof, sol = best.profile, best.stages
    group_size = mesh.size // best.pp
    groups = stage_rank(best.schedule, best.pp, best.virtual)
    plans = []
    for s, rng in enumerate(sol.ranges(len(prof.units))):
        nodes = [n for i in rng for n in prof.units[i].nodes]
        g = groups[s]
        part = _stage_solution(prof, rng, nodes, captured, best, s, stats)
        plans.append(StagePlan(s, nodes, g, list(range(g * group_size, (g + 1) * group_size)), prof.mesh, part,
                               sol.recompute[s]))
    act = [sol.memory[s] - sum(prof.costs[i].state_bytes for i in rng)
           for s, rng in enumerate(sol.ranges(len(prof.units)))]
    return PipelinePlan(best.pp, best.virtual, plans, best.schedule, best.m, best.step_time, best.bubble_fraction, act)


def _stage_solution(prof: SubmeshProfile, rng: range, nodes: list[str], captured: CapturedGraph, best: Choice,
                    s: int, stats: dict) -> Optional[Solution]:
    """The core plan restricted to one stage: its ops, the placeholders they read, its costs."""
    full = prof.solution
    if full is None:
        return None
    mine = set(nodes)
    read = {a.name for n in nodes for a in captured.node(n).all_input_nodes if a.op == "placeholder"}
    strategies = {k: v for k, v in full.strategies.items() if k in mine or k in read}
    fqns = {captured.params[n] for n in read if n in captured.params}
    fqns |= {a for a, c in captured.aliases.items() if c in fqns}
    costs = [prof.costs[i] for i in rng]
    mem = {k: sum(getattr(c, k) for c in costs) for k in ("params", "grads", "optimizer")}
    mem["activations"] = best.stages.memory[s] - sum(mem.values())
    m = best.m
    times = {"compute+communication": m * best.stages.stage_time[s], "grad_sync": best.stages.stage_sync[s]}
    return Solution(
        mesh=prof.mesh, strategies=strategies,
        param_placements={k: v for k, v in full.param_placements.items() if k in fqns},
        estimated_step_time=sum(times.values()), estimated_memory=best.stages.memory[s], memory_breakdown=mem,
        time_breakdown=times, unruled_ops=list(full.unruled_ops),
        redistributions=[r for r in full.redistributions if r.consumer in mine],
        param_grad_syncs={k: v for k, v in full.param_grad_syncs.items() if k in fqns},
        solver_stats=dict(full.solver_stats, pipeline_search=stats, stage=s, recompute=best.stages.recompute[s]))
