"""``autoshard.plan(..., layout=L)``: price exactly the layout ``L`` (``autoshard.layouts``), no search.

Without a pipeline (``L.pp == 1``) everything the layout says is pinned on the program the layout
runs (one microbatch of ``batch / (dp x microbatch_size)``, traced in the mixed precision given):

- every parameter's placement and every batch input's (``passes.sharding.layout_placements``:
  column/row-parallel pairs found from the graph, vocab-parallel embedding and head, FSDP / ZeRO
  sharding over the data-parallel axes, replicated over DDP / HSDP-replica axes), the
  normalisations' sequence split under sequence parallelism, ring attention under cp;
- the levers: the microstep count, the recompute policy of every repeated block, reshard after
  forward (FSDP's own; kept gathered for Megatron's distributed optimizer).

The ILP then only decides how activations move between those fixed points (it still prices the
collectives that implies). With a pipeline (``pp > 1``) the stage planner runs with pp, each rank
group's (dp, tp) submesh, the schedule (interleaved with ``virtual_stages``) and the microbatch count
pinned; it still chooses the stage cut (balanced by cost), each stage's intra-op sharding and its
recompute, since it takes no placement pins yet (say so in what you report).

``plan.solution.solver_stats["layout"]`` (each pipeline stage's solution's) holds ``L.describe()``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from autoshard.layouts import Layout, LayoutError
from autoshard.lever_args import block_types, lever_pins, microbatch
from autoshard.passes.capture.export import capture
from autoshard.passes.levers import MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.sharding.layout_placements import check_tensor_parallel, layout_pins, tensor_parallel_roles
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.pipelined_plans import PipelinedPlan
from autoshard.pipelines import warn_per_microbatch
from autoshard.plans import Plan, graph_fingerprint, plan_work

__all__ = ["plan_with_layout", "check_layout_arguments", "global_batch_of"]


def global_batch_of(example_inputs) -> int:
    """Dim 0 of the first tensor input: the global batch."""
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    raise LayoutError("a layout needs a batch: example_inputs holds no tensor with a batch dim")


def check_layout_arguments(layout, **given) -> None:
    """``layout=`` fixes placements, levers and the pipeline: refuse the keywords that would also set them."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout= takes an autoshard.layouts.Layout (layouts.megatron(...) / layouts.fsdp(...)), "
                        f"got {type(layout).__name__}")
    clash = sorted(k for k, v in given.items() if v not in (None, {}, ()))
    if clash:
        raise TypeError(f"{clash} cannot be combined with layout=: the layout fixes placements, memory levers and "
                        f"the pipeline ({layout.describe()}); drop them, or plan without layout=")


def plan_with_layout(model: torch.nn.Module, mesh: Any, layout: Layout, *, example_inputs, loss_fn, example_target,
                     hardware, memory_limit: Optional[int], optimizer: str, time_limit_s: float,
                     mixed_precision: Optional[MixedPrecision] = None):
    """The plan of ``model`` run exactly as ``layout`` says (module docstring): a ``Plan``, or a
    ``PipelinedPlan`` when ``layout.pp > 1``. ``LayoutError`` when the layout does not fit the mesh
    or the model; ``InfeasiblePlanError`` when it does not fit the memory limit. ``hardware``: resolved
    (a preset name, a profile path or a ``Hardware``; not "auto")."""
    if loss_fn is None or example_target is None:
        raise LayoutError("a layout is a training layout: pass loss_fn= and example_target=")
    world = Mesh.of(mesh).size
    batch = global_batch_of(example_inputs)
    pmesh, axes = layout.planning_mesh(mesh)
    hw = hardware
    label = hw if isinstance(hw, str) else str(getattr(hw, "name", "custom"))
    param_dtype = None if mixed_precision is None else mixed_precision.param_dtype
    if layout.pp > 1:
        if mixed_precision is not None:
            raise LayoutError("mixed_precision= with a pipelined layout is not priced yet (the stage planner traces "
                              "in the model's dtype); pass pp=1 or drop mixed_precision")
        m = layout.pipeline_microbatches(batch, world)
        captured = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
        check_tensor_parallel(captured, tensor_parallel_roles(captured), layout.tp)
        dp = layout.data_parallel(world)
        # the stage planner's pins: pp, the (dp, tp) submesh, schedule, microbatches
        chosen = plan_pipeline(captured, pmesh, hardware=hw, memory_limit=memory_limit, optimizer=optimizer,
                               pp=layout.pp, schedule=layout.schedule_name, microbatches=m,
                               time_limit_s=time_limit_s, shapes=[(dp, layout.tp)])
        for stage in chosen.stages:
            if stage.solution is not None:
                stage.solution.solver_stats["layout"] = layout.describe()
        return PipelinedPlan(chosen, pmesh, label, graph_fingerprint(captured), captured,
                             plan_work(captured, hw, pmesh.size), warn_per_microbatch(captured, chosen.microbatches))
    k = layout.accumulation(batch, world)
    inputs, target = microbatch(example_inputs, example_target, k)
    captured = capture(model, inputs, loss_fn=loss_fn, target=target, param_dtype=param_dtype)
    pins = layout_pins(captured, pmesh, axes, sequence_parallel=layout.sequence_parallel)
    reshard = layout.keeps_gathered_parameters if axes.shard else False
    blocks = bool(block_types(captured))
    levers = lever_pins(accumulation=k, checkpoint=layout.recompute if blocks else None,
                        reshard_after_forward=reshard if blocks else None, mixed_precision=mixed_precision)
    solution = plan_sharding(captured, pmesh, hardware=hw, memory_limit=memory_limit, pins=Pins(**pins),
                             optimizer=optimizer, time_limit_s=time_limit_s, levers=levers, traced_at_microbatch=True)
    solution.solver_stats["layout"] = layout.describe()
    return Plan.build(solution, pmesh, hw, captured)
