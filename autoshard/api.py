"""The front door: ``plan`` (no process group needed) and ``compile`` (under torchrun).

>>> plan = autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> print(plan.summary())
>>> cm = autoshard.compile(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> loss = cm.step(x, target=y); opt.step()

``plan_captured`` plans a program that is already captured (benchmarks and tests capture once and
plan many times). ``compile`` plans on rank 0 only and sends the plan to every rank as JSON
(``runtime.groups.run_and_broadcast``): when planning fails there, every rank raises the same error.
"""
from __future__ import annotations

import fnmatch
import time
from typing import Any, Optional, Union

import torch

from autoshard.compiled import CompiledModel, PipelinedModel
from autoshard.layout_plans import check_layout_arguments, plan_with_layout
from autoshard.lever_args import (LEVER_KEYWORDS, block_types, check_block_levers, check_lever_values, lever_pins,
                                  microbatch, pin_levers)
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.moe import attach_expert_load
from autoshard.passes.errors import InfeasiblePlanError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import BlockPolicy, Levers, MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.generators import generate
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.batch_coupling import batch_coupled_ops
from autoshard.passes.solve.planner import plan_sharding, random_solution
from autoshard.passes.solve.replicated_ops import describe_replicated, replicated_op_costs
from autoshard.passes.solve.solution import Solution
from autoshard.pipelined_plans import CompiledPipelinePlan, PipelinedPlan
from autoshard.pipelines import (build_pipelined_model, check_pipeline_inputs, check_plan_arguments,
                                 microbatch_inputs, plan_pipelined, warn_per_microbatch)
from autoshard.plans import Plan, graph_fingerprint, plan_work
from autoshard.runtime.groups import MeshEnv, run_and_broadcast, setup_distributed
from autoshard.runtime.pipeline.executor import PipelineProgram
from autoshard.runtime.pipeline.split import replan_at_microbatch, stage_nodes_from_prefixes

__all__ = ["plan", "compile", "plan_captured", "resolve_hardware", "hardware_label", "planner_stage_starts",
           "PIN_KEYWORDS", "pin_levers", "check_lever_values", "block_types", "microbatch",
           "LEVER_KEYWORDS", "lever_pins"]

PIN_KEYWORDS = ("params", "inputs", "ops", "strategies")


def _pins(pins: dict) -> Optional[Pins]:
    """The pin keywords of ``plan``/``compile`` as ``Pins`` (None when none is given); TypeError on others."""
    unknown = sorted(set(pins) - set(PIN_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown keyword(s) {unknown}; pins are {list(PIN_KEYWORDS)}")
    given = {k: v for k, v in pins.items() if v}
    return Pins(**given) if given else None


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


def hardware_label(hardware) -> str:
    """How a plan records its hardware: the preset or profile path, or a ``Hardware`` object's name."""
    return hardware if isinstance(hardware, str) else str(getattr(hardware, "name", "custom"))


def plan_captured(captured: CapturedGraph, mesh: Any, *, hardware: Any = "auto", memory_limit: Optional[int] = None,
                  optimizer: str = "adamw", random_seed: Optional[int] = None, time_limit_s: float = 30.0,
                  pins: Optional[dict] = None, accumulation: Optional[int] = None, checkpoint=None,
                  reshard_after_forward=None, mixed_precision: Optional[MixedPrecision] = None,
                  expert_load=None) -> Plan:
    """``plan`` for a program already captured (``passes.capture.export.capture``): capture once, plan
    it for many meshes or pins. Same options as ``plan``, with the pins as one dict
    (``pins={"params": {...}}``); the returned ``Plan`` carries ``captured`` and runs it as is:
    ``captured`` is one microstep, so the microstep count is not chosen here (``accumulation=k`` says
    ``captured`` is one of k microsteps; ``plan`` and ``compile``, which can trace again, choose it).
    With ``mixed_precision``, ``captured`` must have been captured with its ``param_dtype``."""
    levers = lever_pins(accumulation or 1, checkpoint, reshard_after_forward, mixed_precision)
    return _solve(captured, Mesh.of(mesh), levers, traced_at_microbatch=True, hardware=hardware,
                  memory_limit=memory_limit, optimizer=optimizer, random_seed=random_seed, time_limit_s=time_limit_s,
                  pins=pins, expert_load=expert_load)


def _solve(captured: CapturedGraph, mesh: Mesh, levers: LeverPins, *, traced_at_microbatch: bool, hardware,
           memory_limit, optimizer, random_seed, time_limit_s, pins, expert_load=None) -> Plan:
    """The solver's plan (or, with ``random_seed``, a random valid one) of ``captured`` under ``levers``."""
    hw = resolve_hardware(hardware)
    attach_expert_load(captured.gm, expert_load)
    pin_obj = _pins(pins or {})
    if random_seed is not None:
        solution: Solution = random_solution(captured, mesh, seed=random_seed, pins=pin_obj, hardware=hw,
                                             optimizer=optimizer, levers=levers,
                                             traced_at_microbatch=traced_at_microbatch)
    else:
        try:
            solution = plan_sharding(captured, mesh, hardware=hw, memory_limit=memory_limit, pins=pin_obj,
                                     optimizer=optimizer, time_limit_s=time_limit_s, levers=levers,
                                     traced_at_microbatch=traced_at_microbatch)
        except InfeasiblePlanError as e:
            note = describe_replicated(replicated_op_costs(captured, mesh, hw), mesh)
            if not note:
                raise
            raise InfeasiblePlanError(f"{e} {note}") from e
    return Plan.build(solution, mesh, hw, captured)


def plan(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
         hardware: Optional[str] = "auto", memory_limit: Optional[int] = None, optimizer: str = "adamw",
         random_seed: Optional[int] = None, time_limit_s: float = 30.0, pp: Union[None, int, str] = None,
         schedule: Optional[str] = None, microbatches: Optional[int] = None, stages: Optional[list] = None,
         accumulation: Optional[int] = None, checkpoint=None, reshard_after_forward=None,
         mixed_precision: Optional[MixedPrecision] = None, expert_load=None, layout=None,
         **pins) -> Union[Plan, PipelinedPlan]:
    """Trace ``model`` and choose how to shard it over ``mesh``; needs no process group.

    ``layout=autoshard.layouts.megatron(tp=8, ...)`` (or ``layouts.fsdp(...)``): price exactly that
    layout instead of searching (``autoshard.layout_plans``); pins, levers other than
    ``mixed_precision`` and pipeline keywords are then refused.

    ``mesh``: an int, a tuple of ints, an ``autoshard.Mesh`` or a ``DeviceMesh``. ``example_inputs``:
    a tuple of tensors (or a dict of keyword tensors) holding one GLOBAL batch; meta tensors are fine
    and allocate nothing. ``loss_fn(output, target)`` with ``example_target`` makes the planned
    program a training step. ``hardware``: "a100" | "h100" | "h200" | "cpu" | a profile JSON path |
    "auto". ``memory_limit`` (bytes per device) overrides the preset's memory. Pins (each optional):
    ``params={"fc1.weight": ("S(0)", "R")}`` (fnmatch patterns), ``inputs={0: ("S(0)",)}``,
    ``ops={"linear_1": ("S(2)",)}``, ``strategies={node: Strategy}``. ``random_seed`` draws a random
    valid plan instead of solving (for testing the runtime), levers included, priced on ``hardware``
    with ``optimizer``. ``InfeasiblePlanError`` (no plan fits the memory limit) also names the ops
    that run replicated for lack of a sharding rule, with what that costs.

    Mixture-of-experts layers (``passes.capture.moe_experts``) may run expert parallel; ``expert_load``
    prices its load imbalance: per-expert token counts (or shares) for every MoE layer, or a dict from
    MoE layer index to them (``passes.cost.moe``); uniform when not given. Not used by ``pp=`` plans.

    Memory levers, chosen by the planner unless pinned (``plan.solution.levers`` says what it chose):
    ``accumulation=k`` runs the global batch as k sequential microsteps; ``checkpoint="none" |
    "selective" | "full"`` (or ``{"model.layers.#": "full"}`` per repeated-block type) recomputes
    activations before the backward; ``reshard_after_forward=True | False`` (or per block type)
    frees sharded parameters' gathered copies after the forward. ``mixed_precision=
    autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (given, never
    chosen) computes with copies of the parameters in ``param_dtype`` (the program is traced that
    way) and reduces gradients in ``reduce_dtype``; parameters, gradients and optimizer state keep
    the model's own dtype.

    3D plans: ``pp="auto"`` | N (and ``schedule=``, ``microbatches=``, ``stages=``) run the stage
    planner as ``compile`` does, with no process group (``_plan_pipeline``): the result is a
    ``PipelinedPlan`` (same surface; ``compile(..., plan=it)`` runs it under torchrun), or a ``Plan``
    when no pipeline is faster. Pass the whole model: repeated blocks are priced once inside.
    """
    if layout is not None:
        check_layout_arguments(layout, pp=pp, schedule=schedule, microbatches=microbatches, stages=stages,
                               accumulation=accumulation, checkpoint=checkpoint, random_seed=random_seed,
                               reshard_after_forward=reshard_after_forward, expert_load=expert_load, **pins)
        return plan_with_layout(model, mesh, layout, example_inputs=example_inputs, loss_fn=loss_fn,
                                example_target=example_target, hardware=resolve_hardware(hardware),
                                memory_limit=memory_limit, optimizer=optimizer, time_limit_s=time_limit_s,
                                mixed_precision=mixed_precision)
    if _pipeline_degree(pp) or any(v is not None for v in (schedule, microbatches, stages)):
        return _plan_pipeline(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn,
                              example_target=example_target, hardware=hardware, memory_limit=memory_limit,
                              optimizer=optimizer, random_seed=random_seed, time_limit_s=time_limit_s, pp=pp,
                              schedule=schedule, microbatches=microbatches, stages=stages, pins=pins)
    lever_args = {"accumulation": accumulation, "checkpoint": checkpoint,
                  "reshard_after_forward": reshard_after_forward, "mixed_precision": mixed_precision}
    lever_pins(**lever_args)  # bad values fail before tracing
    return _plan_for_runtime(model, Mesh.of(mesh), example_inputs=example_inputs, loss_fn=loss_fn,
                             example_target=example_target, hardware=hardware, memory_limit=memory_limit,
                             optimizer=optimizer, random_seed=random_seed, time_limit_s=time_limit_s, pins=pins,
                             lever_args=lever_args, traced={}, expert_load=expert_load)


def compile(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
            plan: Optional[Plan] = None, state_dict: Optional[dict] = None, hardware: Any = "auto",
            memory_limit: Optional[int] = None, optimizer: str = "adamw", random_seed: Optional[int] = None,
            time_limit_s: float = 30.0, pp: Union[None, int, str] = None, schedule: Optional[str] = None,
            microbatches: Optional[int] = None, stages: Optional[list] = None, accumulation: Optional[int] = None,
            checkpoint: Union[None, str, dict] = None, reshard_after_forward: Union[None, bool, dict] = None,
            mixed_precision: Optional[MixedPrecision] = None, expert_load=None, **pins):
    """Plan ``model`` for ``mesh`` and build this rank's program; call on every rank under torchrun.

    Rank 0 solves (unless ``plan`` is given) and broadcasts the plan as JSON, so every rank runs the
    same plan; when solving fails there, every rank raises that error. Each rank materializes only its own shards: from ``model``'s real parameters, from
    ``state_dict`` (full tensors under the original names), or, for a meta-device model, by replaying
    each module's ``reset_parameters`` so values equal a CPU model built with the same seed.
    ``hardware``: a preset name, a profile JSON path, a ``Hardware`` object or "auto".
    Returns a ``CompiledModel``.

    Pipeline parallelism: ``pp="auto"`` lets the stage planner (``passes.pipeline.stages.planner.plan_pipeline``)
    choose the number of pipeline groups along the mesh's first axis, the stage cut, each group's
    (dp, tp) submesh, the microbatch count and the schedule; ``pp=N`` (N > 1) pins the number of
    groups and leaves the rest to it; ``schedule`` (a name of ``passes/pipeline/schedule/registry.py``:
    "gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-v<N>", "zb-h1", "zbv", "dualpipev"),
    ``microbatches`` and ``stages`` (module-name prefixes, node names or layer-unit indices where
    stages 1.. start) pin those decisions (``_compile_pipeline``). The result is a
    ``PipelinedModel``, or a ``CompiledModel`` when the planner finds no pipeline faster (pp = 1).
    ``pp=None`` (default) or ``pp=1``: no pipeline, the plan above. ``plan`` may be a ``PipelinedPlan``
    (from ``plan(..., pp=...)`` or ``load_plan``): the pipeline is built from it, nothing is planned
    (``_compile_planned_pipeline``).

    Memory levers (``passes.levers``), chosen by the planner unless given here (with ``plan=``: pinned on
    top of the levers the plan carries, ``pin_levers``):
    ``accumulation=k`` runs the global batch as k sequential microsteps (the program is traced at
    ``batch / k``; ``step`` still takes the global batch and returns the mean loss);
    ``checkpoint="none" | "selective" | "full"`` for every repeated-block type, or a dict by block
    type (``{"layers.#": "full"}``); ``reshard_after_forward=True`` (or a dict by block type) frees
    sharded parameters' gathered copies after forward and gathers them again for backward;
    ``mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
    computes with ``param_dtype`` copies of the parameters (traced so), keeps and updates the
    parameters in their own dtype and reduces gradients in ``reduce_dtype``.
    """
    lever_args = {"accumulation": accumulation, "checkpoint": checkpoint,
                  "reshard_after_forward": reshard_after_forward, "mixed_precision": mixed_precision}
    check_lever_values(**lever_args)
    if isinstance(plan, PipelinedPlan):
        if any(v is not None for v in lever_args.values()):
            raise TypeError(f"{[k for k, v in lever_args.items() if v is not None]} cannot be combined with a "
                            "pipelined plan yet: its stages recompute as the stage planner chose")
        return _compile_planned_pipeline(model, mesh, plan, example_inputs=example_inputs, loss_fn=loss_fn,
                                         example_target=example_target, state_dict=state_dict, pp=pp,
                                         schedule=schedule, microbatches=microbatches, stages=stages,
                                         random_seed=random_seed, pins=pins)
    pipelined = _pipeline_degree(pp)
    if pipelined and any(v is not None for v in lever_args.values()):
        raise TypeError(f"{[k for k, v in lever_args.items() if v is not None]} cannot be combined with pp={pp!r} "
                        "yet: a pipeline recomputes per stage (the stage planner decides) and accumulates over "
                        "its microbatches")
    if not pipelined and any(v is not None for v in (schedule, microbatches, stages)):
        raise TypeError("schedule=, microbatches= and stages= configure pipeline parallelism: pass pp='auto' "
                        "(or pp= > 1) too")
    if pipelined:
        bad = [k for k, v in (("plan", plan), ("random_seed", random_seed)) if v is not None]
        bad += [f"{k} (pins)" for k in ("inputs", "ops", "strategies") if pins.get(k)]
        if bad:
            raise TypeError(f"{', '.join(bad)} cannot be combined with pp={pp!r}: a pipeline is planned per stage "
                            "(only params= pins apply, to the stages holding those parameters)")
        _pins(pins)
    mesh = Mesh.of(mesh)
    env = setup_distributed(mesh)
    if pipelined:
        return _compile_pipeline(model, mesh, env, example_inputs=example_inputs, loss_fn=loss_fn,
                                 example_target=example_target, pp=pp, schedule=schedule, microbatches=microbatches,
                                 stages=stages, state_dict=state_dict, hardware=resolve_hardware(hardware),
                                 memory_limit=memory_limit, optimizer=optimizer, time_limit_s=time_limit_s,
                                 pins=pins)
    t0 = time.perf_counter()
    if plan is not None:  # its levers, with the lever arguments pinned on top
        carried = plan.solution.levers
        captured = _capture_microstep(model, example_inputs, loss_fn, example_target, Levers(
            accumulation or carried.accumulation, mixed_precision=mixed_precision or carried.mixed_precision))
        chosen = plan.attach(captured, mesh)
        chosen.solution.levers = pin_levers(captured, carried, **lever_args)
    else:
        traced: dict = {}
        payload = run_and_broadcast(lambda: _plan_for_runtime(
            model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, example_target=example_target,
            hardware=hardware, memory_limit=memory_limit, optimizer=optimizer, random_seed=random_seed,
            time_limit_s=time_limit_s, pins=pins, lever_args=lever_args, traced=traced,
            expert_load=expert_load).to_json(), env=env)
        chosen = Plan.from_json(payload)
        captured = traced.get("captured") or _capture_microstep(model, example_inputs, loss_fn, example_target,
                                                                 chosen.solution.levers)
        chosen = chosen.attach(captured, mesh)
    return CompiledModel(model, chosen, env, state_dict=state_dict, compile_seconds=time.perf_counter() - t0)


def _capture_microstep(model, example_inputs, loss_fn, example_target, levers: Levers) -> CapturedGraph:
    """The program the runtime runs under ``levers``: one of ``levers.accumulation`` microsteps, traced
    with the compute dtype of its mixed precision."""
    inputs, target = microbatch(example_inputs, example_target, levers.accumulation)
    mp = levers.mixed_precision
    return capture(model, inputs, loss_fn=loss_fn, target=target, param_dtype=None if mp is None else mp.param_dtype)


def _plan_for_runtime(model, mesh: Mesh, *, example_inputs, loss_fn, example_target, hardware, memory_limit,
                      optimizer, random_seed, time_limit_s, pins: dict, lever_args: dict, traced: dict,
                      expert_load=None) -> Plan:
    """The plan ``plan`` returns and ``compile`` runs (on rank 0 there), made on the program the runtime
    will run. With a pinned
    ``accumulation`` the microstep program is traced and planned directly; otherwise the planner
    chooses the levers on the global batch's program, and when it cuts the batch into k > 1
    microsteps the microstep program is traced and planned again with every lever pinned to that
    choice. ``traced["captured"]``: the program the plan is for (so rank 0 does not trace it again)."""
    pinned = lever_pins(**lever_args)
    mp = pinned.mixed_precision
    param_dtype = None if mp is None else mp.param_dtype
    options = dict(hardware=hardware, memory_limit=memory_limit, optimizer=optimizer, random_seed=random_seed,
                   time_limit_s=time_limit_s, pins=pins, expert_load=expert_load)
    if pinned.accumulation is None:
        captured = capture(model, example_inputs, loss_fn=loss_fn, target=example_target, param_dtype=param_dtype)
        check_block_levers(captured, lever_args)
        first = _solve(captured, mesh, pinned, traced_at_microbatch=False, **options)
        if first.solution.levers.accumulation == 1:
            traced["captured"] = captured
            return first
        chosen = first.solution.levers
        policy = {t: chosen.blocks.get(t, BlockPolicy()) for t in block_types(captured)}
        pinned = LeverPins(chosen.accumulation, {t: p.checkpoint for t, p in policy.items()} or None,
                           {t: p.reshard_after_forward for t, p in policy.items() if p.checkpoint == "none"} or None,
                           chosen.mixed_precision)
    micro = _capture_microstep(model, example_inputs, loss_fn, example_target,
                               Levers(pinned.accumulation, mixed_precision=mp))
    check_block_levers(micro, lever_args)
    traced["captured"] = micro
    return _solve(micro, mesh, pinned, traced_at_microbatch=True, **options)


def _pipeline_degree(pp) -> bool:
    """Whether ``pp`` asks for pipeline planning: "auto" or an int > 1 (None and 1: no pipeline)."""
    if pp is None:
        return False
    if isinstance(pp, str):
        if pp != "auto":
            raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
        return True
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
    return pp > 1


# ---- pipeline parallelism ----------------------------------------------------------------------

def _plan_pipeline(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn, example_target, hardware,
                   memory_limit, optimizer, random_seed, time_limit_s, pp, schedule, microbatches, stages,
                   pins: dict) -> Union[Plan, PipelinedPlan]:
    """``plan(..., pp=...)``: the stage planner on the whole program, no process group
    (``pipelines.plan_pipelined``). Pins and random plans are refused (TypeError)."""
    if not _pipeline_degree(pp):
        raise TypeError("schedule=, microbatches= and stages= configure pipeline parallelism: pass pp='auto' "
                        "(or pp= > 1) too")
    _pins(pins)
    bad = ["random_seed"] if random_seed is not None else []
    bad += [f"{k} (pins)" for k in PIN_KEYWORDS if pins.get(k)]
    if bad:
        raise TypeError(f"{', '.join(bad)} cannot be combined with plan(..., pp={pp!r}): the stage planner chooses "
                        "each stage's sharding (compile(..., pp=..., params=...) applies parameter pins when it "
                        "re-solves the stages)")
    check_pipeline_inputs(example_inputs)
    mesh = Mesh.of(mesh)
    hw = resolve_hardware(hardware)
    captured = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
    return plan_pipelined(captured, mesh, hardware=hw, hardware_label=hardware_label(hw), memory_limit=memory_limit,
                          optimizer=optimizer, pp=pp, schedule=schedule, microbatches=microbatches,
                          stages=planner_stage_starts(captured, stages), time_limit_s=time_limit_s)


def _compile_planned_pipeline(model: torch.nn.Module, mesh: Any, plan: PipelinedPlan, *, example_inputs, loss_fn,
                              example_target, state_dict, pp, schedule, microbatches, stages, random_seed,
                              pins: dict) -> PipelinedModel:
    """``compile(..., plan=<PipelinedPlan>)``: join the world and build this rank's stages from the plan
    (``pipelines.build_pipelined_model``); nothing is planned, on any rank."""
    check_plan_arguments(plan, pp=pp, schedule=schedule, microbatches=microbatches, stages=stages,
                         random_seed=random_seed, pins=pins)
    mesh = Mesh.of(mesh)
    if mesh.shape != plan.mesh.shape:
        raise PlanFormatError(f"plan was made for mesh {plan.mesh.shape}, not {mesh.shape}: plan again")
    setup_distributed(mesh)
    return build_pipelined_model(plan, model, example_inputs=example_inputs, loss_fn=loss_fn,
                                 example_target=example_target, state_dict=state_dict)


def _compile_pipeline(model: torch.nn.Module, mesh: Mesh, env: MeshEnv, *, example_inputs, loss_fn, example_target,
                      pp, schedule, microbatches, stages, state_dict, hardware, memory_limit, optimizer,
                      time_limit_s, pins: dict):
    """Plan and build a pipeline on every rank with the automatic stage planner.

    Rank 0 traces the program at the global batch and runs ``passes.pipeline.stages.planner.plan_pipeline``,
    which chooses pp (unless ``pp`` is an int), the stage cut, each rank group's (dp, tp) submesh, the
    microbatch count and the schedule, honouring whichever of ``pp``/``schedule``/``microbatches``/
    ``stages`` is pinned. If it chooses pp = 1, the result is an ordinary ``CompiledModel`` with its plan
    (re-solved with the user's pins if any). Otherwise every rank traces the program at microbatch
    shapes, rank 0 re-solves each stage's intra-op plan there on the planner's submesh
    (``split.replan_at_microbatch``; parameter pins matching the stage apply), and the runtime plan
    travels as JSON. Stages the planner recomputes run their forward without autograd and again before
    their backward (``runtime.pipeline.stage``). Returns a ``PipelinedModel`` or a ``CompiledModel``."""
    t0 = time.perf_counter()
    check_pipeline_inputs(example_inputs)
    full = None

    def trace_full():
        nonlocal full
        if full is None:
            full = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
        return full

    def choose() -> dict:
        captured = trace_full()
        chosen = plan_pipeline(captured, mesh, hardware=hardware, memory_limit=memory_limit, optimizer=optimizer,
                               pp=None if pp == "auto" else pp, schedule=schedule, microbatches=microbatches,
                               stages=planner_stage_starts(captured, stages), time_limit_s=time_limit_s)
        out = {"planner": chosen.to_json()}
        warn_per_microbatch(captured, chosen.microbatches if chosen.pp > 1 else 1)
        if chosen.pp == 1:
            solution = chosen.stages[0].solution
            if pins.get("params"):
                solution = plan_sharding(captured, mesh, hardware=hardware, memory_limit=memory_limit,
                                         optimizer=optimizer, time_limit_s=time_limit_s,
                                         pins=Pins(params=pins["params"]))
            out["plan"] = Plan(solution, mesh, hardware_label(hardware), graph_fingerprint(captured),
                               captured).to_json()
        return out

    chosen = run_and_broadcast(choose, env=env)
    planner_plan = PipelinePlan.from_json(chosen["planner"])
    if planner_plan.pp == 1:
        plan = Plan.from_json(chosen["plan"]).attach(trace_full(), mesh)
        return CompiledModel(model, plan, env, state_dict=state_dict, compile_seconds=time.perf_counter() - t0,
                             planner_plan=planner_plan)
    small_inputs, small_target = microbatch_inputs(example_inputs, example_target, planner_plan.microbatches)
    small = capture(model, small_inputs, loss_fn=loss_fn, target=small_target)

    def solve(graph, submesh):
        p = _stage_pins(pins, graph.captured)
        return plan_sharding(graph.captured, submesh, hardware=hardware, memory_limit=memory_limit,
                             optimizer=optimizer, time_limit_s=time_limit_s, pins=Pins(**p) if p else None)

    plan = PipelinePlan.from_json(run_and_broadcast(
        lambda: replan_at_microbatch(planner_plan, trace_full(), small, solve=solve).to_json(), env=env))
    program = PipelineProgram(small, plan, generate(plan.schedule, plan.pp, plan.microbatches, plan.virtual),
                              model=model, state_dict=state_dict)
    coupled = [c.describe() for c in batch_coupled_ops(trace_full())]
    plan = CompiledPipelinePlan.of(plan, mesh, hardware_label(hardware), plan_work(trace_full(), hardware, mesh.size),
                                   coupled)
    return PipelinedModel(plan, program, compile_seconds=time.perf_counter() - t0, planner_plan=planner_plan)


def _stage_pins(pins: dict, stage_captured: CapturedGraph) -> dict:
    """The user's parameter pins that concern this stage (patterns matching one of its parameters)."""
    names = set(stage_captured.params.values()) | set(stage_captured.aliases)
    params = {k: v for k, v in (pins.get("params") or {}).items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    return {"params": params} if params else {}


def planner_stage_starts(captured: CapturedGraph, stages) -> Optional[list]:
    """``compile``'s ``stages=`` as the stage planner takes them: unit indices and node names pass;
    module-name prefixes become the name of the first op they make. None stays None."""
    if stages is None:
        return None
    names = {n.name for n in captured.gm.graph.nodes if n.op == "call_function"}
    out = []
    for s in stages:
        if isinstance(s, int) or s in names:
            out.append(s)
        else:
            cut = stage_nodes_from_prefixes(captured, [str(s)])
            if len(cut) < 2:
                raise PlanFormatError(f"stage boundary {s!r} starts at the program's first op: stage 0 needs ops "
                                      "of its own; name where stages 1.. start")
            out.append(cut[1][0])
    return out
