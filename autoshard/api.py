"""The front door: ``plan`` (no process group needed) and ``compile`` (under torchrun).

>>> plan = autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> print(plan.summary())
>>> cm = autoshard.compile(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> loss = cm.step(x, target=y); opt.step()

``plan_captured`` plans a program that is already captured (benchmarks and tests capture once and
plan many times). ``compile`` plans on rank 0 only and sends the plan to every rank as JSON
(``runtime.groups.run_and_broadcast``): when planning fails there, every rank raises the same error.

Each entry builds its options once (``autoshard.options.PlanOptions``: every keyword ``plan`` and
``compile`` share, checked once) and runs the driver's stages (``autoshard.driver``: trace, choose,
to_microbatch, build); no entry makes a plan any other way.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from autoshard.driver import ModelBatch, build, choose, compile_plan, hardware_label, resolve_hardware, to_microbatch
from autoshard.lever_args import (block_types, check_lever_values, lever_pins, microbatch, pin_levers,
                                  refuse_unrunnable_precision)
from autoshard.options import PIN_KEYWORDS, PlanOptions
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import LEVER_KEYWORDS
from autoshard.passes.mesh import Mesh
from autoshard.pipelines import check_pipeline_inputs, planner_stage_starts
from autoshard.plans import Plan

if TYPE_CHECKING:  # compile's result and runtime load when compile runs: plan() never needs them
    from autoshard.compiled import CompiledModel

__all__ = ["plan", "compile", "plan_captured", "resolve_hardware", "hardware_label", "planner_stage_starts",
           "PIN_KEYWORDS", "pin_levers", "check_lever_values", "block_types", "microbatch",
           "LEVER_KEYWORDS", "lever_pins"]


def plan_captured(captured: CapturedGraph, mesh: Any, *, pins: Optional[dict] = None, **options) -> Plan:
    """``plan`` for a program already captured (``passes.capture.export.capture``): capture once, plan
    it for many meshes or pins. Same options as ``plan``, with the pins as one dict
    (``pins={"params": {...}}``); the returned ``Plan`` carries ``captured`` and runs it as is:
    ``captured`` is one microstep, so the microstep count is not chosen here (``accumulation=k`` says
    ``captured`` is one of k microsteps; ``plan`` and ``compile``, which can trace again, choose it).
    With ``mixed_precision``, ``captured`` must have been captured with its ``param_dtype``."""
    opts = PlanOptions.of(**options, **(pins or {}))
    opts = opts.with_levers(accumulation=opts.levers.get("accumulation", 1))
    opts.check_entry("plan-captured")
    batch = ModelBatch.of_captured(captured, opts.levers["accumulation"], opts.levers.get("mixed_precision"))
    return choose(batch, Mesh.of(mesh), opts).plan


def plan(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
         **options) -> Plan:
    """Trace ``model`` and choose how to shard it over ``mesh``; needs no process group.

    The keywords after ``example_target`` are the options ``plan`` and ``compile`` share
    (``autoshard.options.PlanOptions``: hardware, memory_limit, optimizer, random_seed, time_limit_s,
    pp, schedule, microbatches, stages, expert_load, the memory levers and the pins), checked once
    before anything is traced; an unknown keyword is a TypeError naming it.
    ``layout=autoshard.layouts.megatron(tp=8, ...)`` (or ``layouts.fsdp(...)``) prices exactly that
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
    planner as ``compile`` does, with no process group (``driver.choose``): the result is a ``Plan`` of
    several stages (``plan.pipelined``; ``compile(..., plan=it)`` runs it under torchrun), or of one
    when no pipeline is faster. Pass the whole model: repeated blocks are priced once inside. Every
    memory lever is accepted with ``pp=`` and chosen per stage: ``accumulation=k`` runs the schedule
    k times per step (each round on 1/k of the batch, as torchtitan accumulates under a pipeline; the
    step still computes the one-device full-batch mean loss); with the other levers every stage is
    re-solved at the microbatch on its submesh, the levers given pinned there and the rest chosen for
    that stage (``driver._choose_pipeline``).
    """
    opts = PlanOptions.of(**options)
    opts.check_entry("plan")
    if opts.pipelined:
        check_pipeline_inputs(example_inputs)
    batch = ModelBatch(model, example_inputs, loss_fn, example_target, stack_traces=False)  # priced, never run
    return choose(batch, Mesh.of(mesh), opts).plan



def compile(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
            plan: Optional[Plan] = None, state_dict: Optional[dict] = None, **options) -> CompiledModel:
    """Plan ``model`` for ``mesh`` and build this rank's program; call on every rank under torchrun.

    Rank 0 solves (unless ``plan`` is given) and broadcasts the plan as JSON, so every rank runs the
    same plan; when solving fails there, every rank raises that error (``driver.compile_plan``). Each
    rank materializes only its own shards: from ``model``'s real parameters, from ``state_dict`` (full
    tensors under the original names), or, for a meta-device model, by replaying each module's
    ``reset_parameters`` so values equal a CPU model built with the same seed. ``hardware``: a preset
    name, a profile JSON path, a ``Hardware`` object or "auto". Returns a ``CompiledModel``.

    Pipeline parallelism: ``pp="auto"`` lets the stage planner (``passes.pipeline.stages.planner.plan_pipeline``)
    choose the number of pipeline groups along the mesh's first axis, the stage cut, each group's
    (dp, tp) submesh, the microbatch count and the schedule; ``pp=N`` (N > 1) pins the number of
    groups and leaves the rest to it; ``schedule`` (a name of ``passes/pipeline/schedule/registry.py``:
    "gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-v<N>", "zb-h1", "zbv", "dualpipev"),
    ``microbatches`` and ``stages`` (module-name prefixes, node names or layer-unit indices where
    stages 1.. start) pin those decisions (``driver.choose`` on rank 0, then every stage re-solved at
    the microbatch, ``passes.pipeline.stages.retrace.replan_at_microbatch``). ``cm.plan.pipelined``
    says whether the planner found a pipeline faster (pp = 1: a plan of one stage). ``pp=None``
    (default) or ``pp=1``: no pipeline. ``plan`` may be a pipelined plan (from ``plan(..., pp=...)`` or
    ``load_plan``): the pipeline is built from it, nothing is planned (``driver.to_microbatch`` and
    ``driver.build``).

    Memory levers (``passes.levers``), chosen by the planner unless given here (with a saved plan of
    one stage: pinned on top of the levers it carries, ``lever_args.pin_levers``), with or without
    ``pp=`` (with it, chosen per stage; see ``plan``): ``accumulation=k`` runs the global batch as k
    sequential microsteps (the program is traced at ``batch / k``; ``step`` still takes the global batch
    and returns the mean loss); ``checkpoint="none" | "selective" | "full"`` for every repeated-block
    type, or a dict by block type (``{"layers.#": "full"}``); ``reshard_after_forward=True`` (or a dict by
    block type) frees sharded parameters' gathered copies after forward and gathers them again for
    backward; ``mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)`` computes with ``param_dtype`` copies of the parameters (traced so),
    keeps and updates the parameters in their own dtype and reduces gradients in ``reduce_dtype``.
    """
    from autoshard.rank_traces import same_program_as_rank0
    from autoshard.runtime.groups import setup_distributed

    opts = PlanOptions.of(**options)
    opts.check_entry("compile", saved=plan)
    if opts.pipelined or (plan is not None and plan.pipelined):
        check_pipeline_inputs(example_inputs)
    mesh = Mesh.of(mesh)
    if plan is not None and mesh.shape != plan.mesh.shape:
        raise PlanFormatError(f"plan was made for mesh {plan.mesh.shape}, not {mesh.shape}: plan again")
    if plan is not None:  # before any rank joins: the plan says it all
        refuse_unrunnable_precision(plan)
    env = setup_distributed(mesh)
    started = time.perf_counter()
    batch = ModelBatch(model, example_inputs, loss_fn, example_target)
    if plan is None:
        chosen = compile_plan(batch, mesh, opts, env)
        plan, planner, levers = chosen.plan, chosen.planner, None
        refuse_unrunnable_precision(plan)  # planned here from a layout that asks for it
    else:
        planner, levers = (plan if plan.pipelined else None), dict(opts.levers)
    batch.agree = same_program_as_rank0(env)  # from here on every rank traces; each runs rank 0's program
    runtime = to_microbatch(plan, batch, mesh, levers=levers)
    return build(runtime, batch, env, state_dict=state_dict, planner=planner, started=started,
                 compile=opts.compile_options)
