"""A pipeline stage's parameters in ZeRO forms (``passes.sharding.storage_forms``): when its solve
offers them, and the collectives one step of the stage runs for them.

A stage's Solution is solved at one microbatch (``retrace.replan_at_microbatch``), so the ZeRO
collectives it carries (``Solution.storage_collectives``) are one microstep's. The runtime
(``runtime.zero``, one ``ZeroSync`` per stage) reduces around every weight action of the stage: a
``zero2`` bucket is reduce-scattered once per microbatch of every round (``rounds x microbatches``
per step, held sharded between them), a ``zero1`` bucket once, after the stage's last weight action;
the all-reduce over the other replicated axes and the all-gather after the optimizer step run once
per step. ``step_storage_collectives`` prices that list for the stage, by the same rule
(``storage_buckets.bucket_collectives``) and the same cost model as a plan without a pipeline.

Which stage solves may take ZeRO forms: the stage planner's candidates always may (``layer_costs``
prices them per microbatch and per step, ``plan_submesh`` offers them); a stage re-solved at the
microbatch for the runtime (``retrace.replan_at_microbatch``) takes those its parameter pins name
(``"R/zero1"``: a user's or a layout's distributed optimizer) and those the stage planner chose for it
(``planned_zero_pins``: such parameters keep the planned storage and form). ``zero_step_costs`` is how
the stage planner's unit profiles (``layer_costs.profile_submesh``) price a parameter's form.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from autoshard.passes.cost.model import CostModel, gradient_precision
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.sharding.pins import pins_name_zero_forms
from autoshard.passes.sharding.storage_forms import ZERO1, ZERO2, form_of
from autoshard.passes.spec import Shard, fmt
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.solution import Solution
from autoshard.passes.solve.storage_buckets import bucket_collectives

__all__ = ["pins_name_zero_forms", "planned_zero_pins", "storage_pins", "zero_step_costs", "stage_storage_collectives", "step_storage_collectives"]


def planned_zero_pins(solution: Optional[Solution], captured: CapturedGraph) -> dict[str, tuple[str, ...]]:
    """Parameter pins (FQN -> per-axis storage with its form, ``"R/zero1"``) of the parameters ``solution``
    (a stage of a plan of ``captured``) stores in a ZeRO form: the stage's re-solve at the microbatch
    keeps them, since at one microbatch per solve ``zero1`` is not offered (``lever_search.free_forms``)
    and the forms' per-step prices are the stage planner's. {} without any."""
    if solution is None:
        return {}
    out = {}
    for name, strategy in solution.strategies.items():
        if name in captured.params and any(f in (ZERO1, ZERO2) for f in strategy.lowerings):
            out[captured.params[name]] = tuple(fmt(p) + (f"/{f}" if f else "")
                                               for p, f in zip(strategy.outputs[0], strategy.lowerings))
    return out


def storage_pins(solution: Optional[Solution], captured: CapturedGraph) -> dict[str, tuple[str, ...]]:
    """Parameter pins (FQN -> per-axis storage with its form, as ``planned_zero_pins``) of every parameter
    ``solution`` (of ``captured``) stores, ZeRO form or not. {} without a solution."""
    if solution is None:
        return {}
    def pin(strategy):
        forms = tuple(strategy.lowerings) or (None,) * len(strategy.outputs[0])
        return tuple(fmt(p) + (f"/{f}" if f else "") for p, f in zip(strategy.outputs[0], forms))
    return {captured.params[name]: pin(st) for name, st in solution.strategies.items() if name in captured.params}


def stage_storage_collectives(solution: Solution, captured: CapturedGraph, ctx: PlanContext,
                              microsteps: int) -> list:
    """The ZeRO collectives one step of a stage (``captured``, its program at one microbatch) stored
    as ``solution`` runs, its weight actions running ``microsteps`` times per step (module
    docstring); [] without ZeRO parameters. A plan read from JSON keeps none: this prices them again."""
    mp = solution.levers.mixed_precision if solution.levers is not None else None
    reduce_dtype = None if mp is None else (mp.reduce_dtype or mp.param_dtype)
    cm = CostModel(solution.mesh, ctx.spec, ctx.optimizer, **gradient_precision(mp))
    return bucket_collectives(cm, captured, solution.strategies, microsteps, reduce_dtype)


def step_storage_collectives(solution: Solution, captured: CapturedGraph, ctx: PlanContext,
                             microsteps: int) -> Solution:
    """``solution`` (a stage's, solved at one microbatch) with ``storage_collectives`` the ZeRO
    collectives one step runs when the stage's weight actions run ``microsteps`` times per step
    (rounds x microbatches; module docstring). Its time estimates are left as solved (one
    microbatch's); ``estimated["zero_step_collectives_s"]`` is what the step's list costs."""
    if not solution.storage_collectives:
        return solution
    calls = stage_storage_collectives(solution, captured, ctx, microsteps)
    estimated = dict(solution.estimated or {})
    estimated["zero_step_collectives_s"] = sum(c.seconds for c in calls)
    return replace(solution, storage_collectives=calls, estimated=estimated)


def zero_step_costs(acc: dict, cm: CostModel, name: str, strategy, price, facts) -> None:
    """Add one trained parameter's per-step and per-microbatch costs to its layer unit's ``acc`` (the
    fields of ``layer_costs.UnitCost``; ``price``: its ``NodePrice`` by ``cm``, ``facts``: ``GraphFacts``): gradient
    reductions, the optimizer's update and a microbatch's gradient accumulation. In a ZeRO form
    (``passes.cost.storage_prices``, priced here at one microbatch per step) a ``zero2`` reduce-scatter
    runs every microbatch (the backward's fixed cost), a ``zero1`` one once per step with the other
    syncs; the optimizer updates the ZeRO slice only, a ``zero2`` gradient accumulates into that slice,
    and the parameter all-gather after the optimizer step (``phase="step"``, exposed: the runtime
    gathers before the next step's forward) counts with the optimizer step."""
    meta = facts.tensor_outputs(name)[0]
    storage = strategy.outputs[0]
    form = form_of(strategy, meta.shape, cm.mesh.shape)
    master = facts.master_dtype(name)
    sliced = storage
    if form.zero:
        sliced = tuple(Shard(form.zero_dim) if a in form.zero_axes else p for a, p in enumerate(storage))
    for c in price.grad_sync:
        if form.zero and not form.zero_reduced_once and c.kind == "reduce_scatter":
            acc["bwd_fixed"] += c.seconds
        else:
            acc["grad_sync"] += c.seconds
    acc["opt_step"] += cm.optimizer_step_seconds(meta, sliced, master)
    acc["opt_step"] += sum(c.seconds for c in price.collectives if c.phase == "step")
    acc["accumulate"] += cm.accumulate_seconds(meta, storage if form.zero_reduced_once else sliced, master)
