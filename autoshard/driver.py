"""The one driver behind the front door: four stages, every entry path made of them.

    trace(batch, microsteps)            -> CapturedGraph  (the program at one of k microsteps; kept)
    choose(batch, mesh, options)        -> Chosen         (the Plan, with the stage planner's choice
                                                           when pp= was asked)
    to_microbatch(plan, batch, mesh)    -> the plan bound to the program the runtime runs (one microbatch)
    build(runtime_plan, batch, env)     -> CompiledModel

- ``autoshard.plan`` = ``choose`` (which traces);
- ``autoshard.plan_captured`` = ``choose`` on a program already traced;
- ``autoshard.compile`` = ``compile_plan`` (``choose`` on rank 0, its pipeline stages re-solved at the
  microbatch there too, broadcast as JSON, then ``to_microbatch`` on every rank) and ``build``; a saved
  plan (``compile(plan=...)``) enters at ``to_microbatch``.

``ModelBatch`` is what is traced (the model, one global batch, the loss); it keeps each trace, so no
stage traces the same program twice (rank 0 reuses in ``to_microbatch`` what ``choose`` traced).
No other function makes a plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from autoshard.batch_fit import check_batch_uses_mesh
from autoshard.layout_plans import (check_pipelined_layout, layout_pins_and_levers, layout_run, layout_stage_starts,
                                    mesh_layout_hints, published_layout_hints, stamp_layout)
from autoshard.lever_args import block_types, check_block_levers, microbatch, pin_levers
from autoshard.options import PlanOptions
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.moe import attach_expert_load
from autoshard.passes.errors import InfeasiblePlanError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import BlockPolicy, Levers, MixedPrecision, block_levers, lever_rows
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.pinned_shapes import usable_stage_shapes
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.pipeline.stages.retrace import microbatch_plan, replan_at_microbatch
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.random_plans import random_solution
from autoshard.passes.solve.replicated_ops import describe_replicated, replicated_op_costs
from autoshard.passes.gc_pauses import fewer_gc_pauses
from autoshard.pipelines import check_pipeline_inputs, planner_stage_starts, warn_per_microbatch
from autoshard.plans import Plan, graph_fingerprint, hardware_label

if TYPE_CHECKING:  # the runtime loads when a program is built: planning never needs it
    from autoshard.compiled import CompiledModel

__all__ = ["ModelBatch", "Chosen", "trace", "choose", "compile_plan", "to_microbatch", "build", "build_from_plan",
           "resolve_hardware", "hardware_label", "planning_context"]


def resolve_hardware(hardware):
    """``None``/"auto": the local accelerator's preset if it has one, else "cpu". Anything else (a preset
    name, a profile path, a ``Hardware`` object) passes through."""
    if hardware not in (None, "auto"):
        return hardware
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper()
        for preset in ("H200", "H100", "A100"):
            if preset in name:
                return preset.lower()
    return "cpu"


def planning_context(options: PlanOptions, hardware) -> PlanContext:
    """The one ``PlanContext`` of ``options`` with ``hardware`` already resolved (``resolve_hardware``)."""
    return PlanContext.of(hardware, options.memory_limit, options.optimizer, options.time_limit_s)


# ---- trace ----------------------------------------------------------------------------------------

@dataclass
class ModelBatch:
    """What is traced: ``model`` on one GLOBAL batch (``example_inputs``, ``example_target``) with
    ``loss_fn``. ``traces``: the programs traced so far, by (microsteps, compute dtype name).
    ``stack_traces``: whether they record each op's source line (``capture``); ``plan`` turns it off,
    as its programs are priced, never run.
    ``agree``: applied once to every program ``trace`` returns from then on (``compile`` sets it once the
    plan is chosen: ``rank_traces.same_program_as_rank0``, a collective every rank calls alike)."""
    model: Optional[torch.nn.Module]
    example_inputs: Any = None
    loss_fn: Optional[Callable] = None
    example_target: Any = None
    traces: dict = field(default_factory=dict, repr=False)
    agree: Optional[Callable[[CapturedGraph], CapturedGraph]] = field(default=None, repr=False)
    agreed: set = field(default_factory=set, repr=False)
    stack_traces: bool = True

    @classmethod
    def of_captured(cls, captured: CapturedGraph, microsteps: int = 1,
                    mixed_precision: Optional[MixedPrecision] = None) -> "ModelBatch":
        """A batch whose only program is ``captured``, one of ``microsteps`` (``plan_captured``)."""
        return cls(None, traces={_key(microsteps, mixed_precision): captured})


def _key(microsteps: int, mixed_precision: Optional[MixedPrecision]) -> tuple:
    return int(microsteps), None if mixed_precision is None else mixed_precision.param_dtype_name


def trace(batch: ModelBatch, microsteps: int = 1, mixed_precision: Optional[MixedPrecision] = None, *,
          keyword: str = "accumulation") -> CapturedGraph:
    """The program one of ``microsteps`` runs (the first ``1/microsteps`` of the batch along dim 0),
    computing with ``mixed_precision``'s ``param_dtype``; traced once per batch. ``keyword`` names the
    argument that asked for ``microsteps`` in errors ("microbatches" for pipeline stages)."""
    key = _key(microsteps, mixed_precision)
    if key not in batch.traces:
        if batch.model is None:
            raise PlanFormatError(f"this program was given already traced, as one of {next(iter(batch.traces))[0]} "
                                  f"microsteps; {keyword}={microsteps} needs it traced again: plan the model with "
                                  "autoshard.plan instead of plan_captured")
        inputs, target = microbatch(batch.example_inputs, batch.example_target, microsteps, keyword=keyword)
        batch.traces[key] = capture(batch.model, inputs, loss_fn=batch.loss_fn, target=target,
                                    param_dtype=None if mixed_precision is None else mixed_precision.param_dtype,
                                    stack_traces=batch.stack_traces)
    if batch.agree is not None and key not in batch.agreed:
        batch.traces[key] = batch.agree(batch.traces[key])
        batch.agreed.add(key)
    return batch.traces[key]


# ---- choose ---------------------------------------------------------------------------------------

@dataclass
class Chosen:
    """``choose``'s result: ``plan`` and, when ``pp=`` was asked, ``planner``, the stage planner's own
    plan (one stage when it chose no pipeline). JSON both ways (how ``compile`` sends it)."""
    plan: Plan
    planner: Optional[Plan] = None

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "planner": None if self.planner is None else self.planner.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "Chosen":
        return cls(Plan.from_json(data["plan"]), None if data.get("planner") is None else Plan.from_json(data["planner"]))


@fewer_gc_pauses
def choose(batch: ModelBatch, mesh: Mesh, options: PlanOptions, *, for_runtime: bool = False) -> Chosen:
    """The plan for ``batch`` on ``mesh``: the stage planner's when ``options.pipelined``, else the
    sharding planner's, levers included (``_choose_sharding``). ``for_runtime`` (``compile``): a
    pipeline's stages are re-solved at the microbatch, as the runtime runs them (``_choose_pipeline``)."""
    ctx = planning_context(options, resolve_hardware(options.hardware))  # the one context, handed down
    if options.layout is not None:
        return _choose_layout(batch, mesh, options, ctx)
    if options.pipelined:
        return _choose_pipeline(batch, mesh, options, ctx, for_runtime)
    plan = _choose_sharding(batch, mesh, options, ctx)
    if options.random_seed is None and not any(options.pins.values()):  # what was asked for runs as asked
        check_batch_uses_mesh(plan)
    return Chosen(plan)


def _choose_layout(batch: ModelBatch, mesh: Mesh, options: PlanOptions, ctx: PlanContext) -> Chosen:
    """Exactly ``options.layout`` (``autoshard.layout_plans``): with pp == 1 its microstep program
    solved with every placement and lever pinned; with pp > 1 the stage planner with pp, the (dp, tp)
    submesh, the schedule, the microbatch count, (full or none) recompute, every placement and the even
    stage cut pinned."""
    layout = options.layout
    mixed_precision = options.levers.get("mixed_precision")
    run = layout_run(layout, mesh, batch.example_inputs, loss_fn=batch.loss_fn, example_target=batch.example_target,
                     mixed_precision=mixed_precision)
    if layout.pp > 1:
        full = trace(batch)
        check_pipelined_layout(full, run)
        chosen = plan_pipeline(full, run.mesh, ctx, PipelinePins(
            pp=layout.pp, schedule=layout.schedule_name, microbatches=run.microbatches,
            stages=layout_stage_starts(full, layout), shapes=[run.submesh_shape], recompute=run.stage_recompute,
            pins_for=run.stage_pins, overlap_grad_sync=layout.overlaps_communication,
            scatter_gather=layout.scatter_gathers_stage_boundaries, blocking_sends=layout.sends_block_the_sender,
            deepspeed_gathers=layout.gathers_as_deepspeed, mixed_precision=run.mixed_precision))
        stamp_layout([stage.solution for stage in chosen.stages], layout)
        return Chosen(replace(chosen, batch_coupled=warn_per_microbatch(full, chosen.microbatches)), chosen)
    captured = trace(batch, run.microsteps, run.mixed_precision)
    pins, levers = layout_pins_and_levers(captured, run, run.mixed_precision)
    solution = plan_sharding(captured, run.mesh, ctx, pins=pins, levers=levers, traced_at_microbatch=True)
    stamp_layout([solution], layout)
    return Chosen(Plan.of_solution(solution, run.mesh, ctx.hardware, captured))


def _choose_sharding(batch: ModelBatch, mesh: Mesh, options: PlanOptions, ctx: PlanContext) -> Plan:
    """The plan made on the program the runtime will run. With a pinned ``accumulation`` the microstep
    program is traced and planned directly; otherwise the planner chooses the levers on the global
    batch's program, and when it cuts the batch into k > 1 microsteps the microstep program is traced
    and planned again with every lever pinned to that choice."""
    pinned = options.lever_pins()
    if pinned.accumulation is None:
        captured = trace(batch, 1, pinned.mixed_precision)
        check_block_levers(captured, options.levers)
        first = _solve(captured, mesh, pinned, options, ctx, traced_at_microbatch=False)
        if first.solution.levers.accumulation == 1:
            return first
        pinned = _pins_of(first.solution.levers, captured)
    micro = trace(batch, pinned.accumulation, pinned.mixed_precision)
    check_block_levers(micro, options.levers)
    return _solve(micro, mesh, pinned, options, ctx, traced_at_microbatch=True)


def _pins_of(chosen: Levers, captured: CapturedGraph) -> LeverPins:
    """Every lever pinned to ``chosen`` (per block type of ``captured``). A per-block lever is pinned only
    where the block's other levers do not force it (``Lever.forced_by``: a recomputing block always
    gathers again)."""
    policy = {t: chosen.blocks.get(t, BlockPolicy()) for t in block_types(captured)}
    per_block = {row.keyword: {t: getattr(p, row.keyword) for t, p in policy.items()
                               if row.forced_by is None or row.forced_by(
                                   {r.keyword: getattr(p, r.keyword) for r in block_levers() if r is not row}) is None}
                 for row in block_levers()}
    step = {row.keyword: getattr(chosen, row.keyword) for row in lever_rows() if not row.per_block}
    return LeverPins(**step, **{k: v or None for k, v in per_block.items()})


def _solve(captured: CapturedGraph, mesh: Mesh, levers: LeverPins, options: PlanOptions, ctx: PlanContext, *,
           traced_at_microbatch: bool) -> Plan:
    """The solver's plan (or, with ``random_seed``, a random valid one) of ``captured`` under ``levers``."""
    attach_expert_load(captured.gm, options.expert_load)
    pins = options.pin_object()
    if options.random_seed is not None:
        solution = random_solution(captured, mesh, ctx, seed=options.random_seed, pins=pins, levers=levers,
                                   traced_at_microbatch=traced_at_microbatch)
    else:
        try:
            solution = plan_sharding(captured, mesh, ctx, pins=pins, levers=levers,
                                     traced_at_microbatch=traced_at_microbatch, hints_for=mesh_layout_hints)
        except InfeasiblePlanError as e:
            note = describe_replicated(replicated_op_costs(captured, mesh, ctx.spec), mesh)
            if not note:
                raise
            raise InfeasiblePlanError(f"{e} {note}") from e
    return Plan.of_solution(solution, mesh, ctx.hardware, captured)


def _choose_pipeline(batch: ModelBatch, mesh: Mesh, options: PlanOptions, ctx: PlanContext,
                     for_runtime: bool) -> Chosen:
    """The stage planner on the program of one round of ``accumulation`` (the global batch without it;
    ``passes.pipeline.stages.planner``): its plan, or the sharding planner's when no pipeline is faster
    (re-solved with ``params=`` pins if any, or with the levers given). With ``accumulation=k`` the
    schedule runs k times per step: every stage's levers record k and the step time is k rounds (an
    upper bound: the gradient sync one round exposes is counted in each). With the other memory levers
    given, or ``for_runtime``, every stage is re-solved at the microbatch on its submesh
    (``retrace.replan_at_microbatch``): pinned levers as given, the others chosen per stage, each
    stage's estimates its own; the plan is then bound to the program of one microbatch."""
    rounds = int(options.levers.get("accumulation") or 1)
    mixed_precision = options.levers.get("mixed_precision")
    full = trace(batch, rounds, mixed_precision)
    check_block_levers(full, options.levers)
    # a user's params pins hold on the chosen stage submesh as written: the search plans only those
    pps = [options.pp_pin] if options.pp_pin else [p for p in range(2, mesh.size + 1) if mesh.size % p == 0]
    shapes = usable_stage_shapes(full, mesh, ctx.spec, options.pins.get("params"), pps)
    chosen = plan_pipeline(full, mesh, ctx, PipelinePins(pp=options.pp_pin, schedule=options.schedule,
                                                         microbatches=options.microbatches,
                                                         stages=planner_stage_starts(full, options.stages),
                                                         shapes=shapes),
                           hints_for=published_layout_hints)
    if not chosen.pipelined:
        if options.levers:
            return Chosen(_choose_sharding(batch, mesh, options, ctx), chosen)
        warn_per_microbatch(full, 1)
        solution = chosen.stages[0].solution
        if options.pins.get("params"):
            solution = plan_sharding(full, mesh, ctx, pins=Pins(params=options.pins["params"]))
        return Chosen(Plan.of_solution(solution, mesh, ctx.hardware, full), chosen)
    coupled = warn_per_microbatch(full, rounds * chosen.microbatches)
    plan = replace(chosen, batch_coupled=coupled)
    if rounds > 1:
        for stage in plan.stages:
            stage.solution.levers = replace(stage.solution.levers, accumulation=rounds)
        plan.simulated_step_time = rounds * chosen.simulated_step_time
    block_levers_given = any(k not in ("accumulation",) for k in options.levers)
    if block_levers_given or for_runtime:
        small = trace(batch, rounds * plan.microbatches, mixed_precision, keyword="microbatches")
        plan = replan_at_microbatch(plan, full, small, ctx,
                                    params=options.pins.get("params"),
                                    levers=options.lever_pins(accumulation=1) if block_levers_given else None)
    return Chosen(plan, chosen)


def compile_plan(batch: ModelBatch, mesh: Mesh, options: PlanOptions, env: Any) -> Chosen:
    """``compile``'s choice: ``choose(..., for_runtime=True)`` on rank 0 only, sent to every rank as JSON
    (``runtime.groups.run_and_broadcast``: when it fails there, every rank raises the same error)."""
    from autoshard.runtime.groups import run_and_broadcast
    return Chosen.from_json(run_and_broadcast(lambda: choose(batch, mesh, options, for_runtime=True).to_json(),
                                              env=env))


# ---- to_microbatch --------------------------------------------------------------------------------

def to_microbatch(plan: Plan, batch: ModelBatch, mesh: Mesh, *, levers: Optional[dict] = None) -> Plan:
    """``plan`` bound to the program the runtime runs, one microbatch's (``PlanFormatError`` if it was
    made for another model, batch or mesh).

    A plan of one stage: the program of one of its accumulation microsteps, with the lever keywords
    ``levers`` pinned on top of the levers it carries (``lever_args.pin_levers``). A pipeline: the
    program at the microbatch size (the batch / (accumulation x microbatches)); a plan already made
    there is bound as it is, one made on the program of one round has every decision moved onto it
    (``retrace.microbatch_plan``: nothing is solved)."""
    if plan.pipelined:
        mixed_precision = plan.stages[0].solution.levers.mixed_precision if plan.stages[0].solution else None
        small = trace(batch, plan.accumulation * plan.microbatches, mixed_precision, keyword="microbatches")
        if plan.fingerprint == graph_fingerprint(small):
            return plan.attach(small, mesh)
        full = trace(batch, plan.accumulation, mixed_precision)
        return microbatch_plan(plan.attach(full, mesh), small)
    carried = plan.solution.levers
    levers = {k: v for k, v in (levers or {}).items() if v is not None}
    captured = trace(batch, levers.get("accumulation") or carried.accumulation,
                     levers.get("mixed_precision") or carried.mixed_precision)
    bound = plan.attach(captured, mesh)
    if levers:
        bound.solution.levers = pin_levers(captured, carried, **levers)
    return bound


# ---- build ----------------------------------------------------------------------------------------

def build(runtime: Plan, batch: ModelBatch, env: Any, *, state_dict: Optional[dict] = None, device: Any = None,
          planner: Optional[Plan] = None, started: Optional[float] = None, compile: Any = None) -> CompiledModel:
    """This rank's ``CompiledModel`` for ``runtime`` (``to_microbatch``'s result). ``planner``: the stage
    planner's choice it came from, kept on the result; ``started``: when compiling began; ``compile``:
    ``CompileOptions`` to run every stage's program through ``torch.compile`` by regions."""
    from autoshard.compiled import CompiledModel
    started = time.perf_counter() if started is None else started
    model = CompiledModel(batch.model, runtime, env, state_dict=state_dict, device=device, planner_plan=planner,
                          compile=compile)
    model.compile_seconds = time.perf_counter() - started
    return model


def build_from_plan(plan: Plan, model: torch.nn.Module, *, example_inputs, loss_fn=None, example_target=None,
                    state_dict: Optional[dict] = None, device: Any = None,
                    traces: tuple[Optional[CapturedGraph], Optional[CapturedGraph]] = (None, None)) -> CompiledModel:
    """This rank's ``CompiledModel`` for a saved pipelined ``plan`` (``to_microbatch`` then ``build``);
    ``torch.distributed`` must be initialized with the plan's world. ``device``: where the local shards
    live (default: the backend's device; "meta" builds the programs without allocating). ``traces``:
    (full, small), the model already traced at one round of the batch / at the microbatch size (a caller
    building several ranks' programs in one process traces once); None where not traced yet."""
    full, small = traces
    started = time.perf_counter()
    check_pipeline_inputs(example_inputs)
    batch = ModelBatch(model, example_inputs, loss_fn, example_target)
    if full is not None:
        batch.traces[_key(plan.accumulation, None)] = full
    if small is not None:
        batch.traces[_key(plan.accumulation * plan.microbatches, None)] = small
    runtime = to_microbatch(plan, batch, plan.mesh)
    return build(runtime, batch, None, state_dict=state_dict, device=device, planner=plan, started=started)
