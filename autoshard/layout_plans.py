"""``autoshard.plan(..., layout=L)``: what the layout ``L`` (``autoshard.layouts``) fixes, for the driver
(``autoshard.driver.choose``), which traces, solves and builds the plan as for any other entry path.

Without a pipeline (``L.pp == 1``) everything the layout says is pinned on the program the layout
runs (one microbatch of ``batch / (dp x microbatch_size)``, traced in the mixed precision given):

- every parameter's placement and every batch input's (``passes.sharding.layout_placements``:
  column/row-parallel pairs found from the graph, vocab-parallel embedding and head, FSDP / ZeRO
  sharding over the data-parallel axes, replicated over DDP / HSDP-replica axes), the
  normalisations' sequence split under sequence parallelism, ring attention under cp;
- the levers: the microstep count, the recompute policy of every repeated block, reshard after
  forward (FSDP's own). Megatron's distributed optimizer is ZeRO-1 (``R/zero1`` over dp).

The ILP then only decides how activations move between those fixed points (it still prices the
collectives that implies). With a pipeline (``pp > 1``) the stage planner runs with pp, each rank
group's (dp, tp) submesh, the schedule (interleaved with ``virtual_stages``), the microbatch count
and the recompute pinned (``recompute="full"``: every stage recomputes its forward; ``"none"``: none
does; ``"selective"`` has no stage-level form, so each stage's is the planner's), and the same
placements pinned on the submesh (``LayoutRun.stage_pins``: tp over its second axis; over the data-
parallel axis FSDP shards, gathering for every microbatch as the stage planner prices sharded
storage, and Megatron replicates, with its distributed optimizer as ZeRO-1: ``R/zero1``, the optimizer
state sharded over dp, the pins asking the stage solves for storage forms). The stage cut is Megatron's and torchtitan's too: the
numbered blocks split evenly over the stages (``layout_stage_starts``; a program without numbered
blocks is cut by the stage planner, balanced by cost). The planner still chooses how activations
move between the pinned points; a tensor crossing a cut is sent as the stage that makes it holds it
(under sequence parallelism the residual stream is sequence-split over tp, which is how Megatron-LM
sends it between stages).

``plan.solution.solver_stats["layout"]`` (each pipeline stage's solution's) holds ``L.describe()``
(``stamp_layout``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from autoshard.layout_meshes import stage_submesh
from autoshard.layouts import Layout, LayoutError
from autoshard.lever_args import block_types, lever_pins
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.levers import MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.layer_costs import layer_units
from autoshard.passes.sharding.layout_placements import (LayoutAxes, check_tensor_parallel, layout_pins,
                                                         tensor_parallel_roles)
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.lever_pins import LeverPins

__all__ = ["check_layout_arguments", "global_batch_of", "LayoutRun", "layout_run", "layout_mixed_precision",
           "layout_pins_and_levers",
           "check_pipelined_layout", "layout_stage_starts", "stage_block_counts", "stamp_layout", "published_layout_hints",
           "mesh_layout_hints"]


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


class LayoutRun:
    """How ``layout`` runs on ``mesh`` for a global batch: the planning mesh and its axes roles, the
    microstep count (pp == 1) or the pipeline's microbatch count, (dp, tp) submesh and stage
    recompute pin (pp > 1: True, False, or None when the layout's policy has no stage-level form)."""

    def __init__(self, layout: Layout, mesh: Mesh, global_batch: int):
        self.layout = layout
        #: the mixed precision the layout runs with (``layout_mixed_precision``; ``layout_run`` sets it)
        self.mixed_precision: Optional[MixedPrecision] = layout_mixed_precision(layout, None)
        self.mesh, self.axes = layout.planning_mesh(mesh)
        world = Mesh.of(mesh).size
        if layout.pp > 1:
            self.microbatches = layout.pipeline_microbatches(global_batch, world)
            submesh, self.stage_axes = stage_submesh(layout, world)
            self.submesh_shape = submesh.shape
            self.microsteps = 1
            # the stage planner recomputes whole stages: "full" and "none" pin that; "selective" (a
            # policy inside each block) has no stage-level form, so the stage planner still chooses
            self.stage_recompute = {"full": True, "none": False}.get(layout.recompute)
            # Megatron's distributed optimizer computes with replicated parameters and shards only the
            # optimizer state: ZeRO-1, ``R/zero1`` over the data axes (``layout_meshes.stage_submesh``)
        else:
            self.microsteps = layout.accumulation(global_batch, world)
            self.stage_recompute = None
            self.stage_axes = None

    def stage_pins(self, captured: CapturedGraph, submesh: Mesh) -> Pins:
        """The layout's placements on ``captured`` (the stage planner's program, or a stage's) over one
        rank group's (dp, tp) ``submesh`` (``passes.sharding.pins.PinsFor``)."""
        if self.stage_axes is None:
            raise LayoutError("stage_pins: this layout has no pipeline (pp == 1)")
        pins = layout_pins(captured, submesh, self.stage_axes, sequence_parallel=self.layout.sequence_parallel)
        if self.layout.sequence_parallel:  # the residual stream placed as the sequence-split norms' outputs
            norms = {name: pls for name, pls in pins["ops"].items() if "P" not in pls}
            pins["ops"].update(_residual_stream_between_units(captured, norms))
        return Pins(**pins)


def _residual_stream_between_units(captured: CapturedGraph, norm_pins: dict) -> dict:
    """Under sequence parallelism Megatron keeps the residual stream sequence-split over tp outside
    its tensor-parallel regions, so what passes from one block to the next (and crosses a stage cut)
    is that split. Pins for each residual add (``aten.add``) whose value crosses a layer-unit boundary
    and has a pinned norm output's shape (the residual stream's), placed as that norm output is; empty
    without such pins. Another op there (OPT reshapes its hidden states after the add) is left to the
    solver: not every op can output a sequence split."""
    placed = {}
    for name, pls in norm_pins.items():
        meta = captured.node(name).meta.get(META)
        if meta is not None and hasattr(meta, "shape"):
            placed.setdefault(tuple(meta.shape), pls)
    if not placed:
        return {}
    unit_of = {n: i for i, u in enumerate(layer_units(captured)) for n in u.nodes}
    out = {}
    for node in captured.gm.graph.nodes:
        if node.name not in unit_of:
            continue
        meta = node.meta.get(META)
        shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None
        later = any(unit_of.get(u.name, -1) > unit_of[node.name] for u in node.users)
        if later and shape in placed and node.target is torch.ops.aten.add.Tensor:
            out[node.name] = placed[shape]
    return out


def layout_run(layout: Layout, mesh: Any, example_inputs, *, loss_fn, example_target,
               mixed_precision: Optional[MixedPrecision]) -> LayoutRun:
    """``LayoutRun`` of ``layout`` (``LayoutError`` for a forward-only program or a pipelined layout
    with mixed precision, which the stage planner does not price yet); ``run.mixed_precision`` is
    ``layout_mixed_precision`` of the one given."""
    if loss_fn is None or example_target is None:
        raise LayoutError("a layout is a training layout: pass loss_fn= and example_target=")
    if layout.pp > 1 and mixed_precision is not None:
        raise LayoutError("mixed_precision= with a pipelined layout is not priced yet (the stage planner traces "
                          "in the model's dtype); pass pp=1 or drop mixed_precision")
    run = LayoutRun(layout, Mesh.of(mesh), global_batch_of(example_inputs))
    run.mixed_precision = layout_mixed_precision(layout, mixed_precision)
    return run


def layout_mixed_precision(layout: Layout, mixed_precision: Optional[MixedPrecision]) -> Optional[MixedPrecision]:
    """The mixed precision ``layout`` runs with, ``mixed_precision`` (the user's) as given unless the layout
    accumulates and reduces gradients in fp32 (``accumulate_allreduce_grads_in_fp32``, Megatron-LM's main
    gradients): then ``MixedPrecision(param_dtype=<given>, reduce_dtype=torch.float32,
    accumulate_in_reduce_dtype=True)``, so that every price reading ``mixed_precision`` (the gradient
    sync's bytes, the accumulations, the gradients held) takes it. ``LayoutError`` for a given
    ``reduce_dtype`` other than float32."""
    if not layout.accumulate_allreduce_grads_in_fp32:
        return mixed_precision
    if mixed_precision is not None and mixed_precision.reduce_dtype not in (None, torch.float32):
        raise LayoutError(f"accumulate_allreduce_grads_in_fp32 reduces gradients in float32, but mixed_precision= "
                          f"reduces them in {mixed_precision.reduce_dtype_name}: drop one of the two")
    return MixedPrecision(param_dtype=None if mixed_precision is None else mixed_precision.param_dtype,
                          reduce_dtype=torch.float32, accumulate_in_reduce_dtype=True)


def layout_pins_and_levers(captured: CapturedGraph, run: LayoutRun,
                           mixed_precision: Optional[MixedPrecision]) -> tuple[Pins, LeverPins]:
    """Every placement and lever the layout fixes on ``captured`` (one of ``run.microsteps``)."""
    layout = run.layout
    pins = layout_pins(captured, run.mesh, run.axes, sequence_parallel=layout.sequence_parallel)
    reshard = layout.keeps_gathered_parameters if run.axes.shard else False
    blocks = bool(block_types(captured))
    levers = lever_pins(accumulation=run.microsteps, checkpoint=layout.recompute if blocks else None,
                        reshard_after_forward=reshard if blocks else None, mixed_precision=mixed_precision)
    return Pins(**pins), levers


def check_pipelined_layout(captured: CapturedGraph, run: LayoutRun) -> None:
    """tp must divide the attention heads of ``captured`` (the stage planner would not say why)."""
    check_tensor_parallel(captured, tensor_parallel_roles(captured), run.layout.tp)


def layout_stage_starts(captured: CapturedGraph, layout: Layout) -> Optional[list[int]]:
    """Megatron-LM's and torchtitan's stage cut, as layer-unit indices (``layer_units(captured)``) where
    stages 1.. of the pp x virtual_stages stages start (stage k in model order runs on rank k mod pp).

    Even split: the numbered blocks split evenly over the stages, the first stage also holding what
    comes before the blocks and the last what comes after (the embedding; the final norm, head and
    loss). Where the stage count does not divide the blocks (Megatron refuses that), the extra blocks
    go to the stages nearest the middle, so the first and last stages, which also hold the embedding
    and the head, get one fewer: Llama 3 405B's 126 layers on 32 stages (3, 4, ..., 4, 3).

    Uneven, with Megatron-Core's options: ``account_for_embedding_in_pipeline_split`` /
    ``account_for_loss_in_pipeline_split`` count the embedding / the head as one more block of the
    even split (126 blocks + 2 on 16 x 8 stages: the first stage holds only the embedding, the last
    only the head, Meta's Llama 3 405B layout); ``decoder_first_pipeline_num_layers`` /
    ``decoder_last_pipeline_num_layers`` give pipeline rank 0's / rank pp-1's blocks (split evenly over
    its virtual stages), the other ranks' stages sharing the rest evenly.

    None for a program without numbered blocks: the stage planner then cuts it, balanced by cost.
    ``LayoutError`` when a stage would hold nothing."""
    units = layer_units(captured)
    blocks = [i for i, u in enumerate(units) if u.block is not None]
    stages = layout.pp * layout.virtual_stages
    if not blocks:
        return None
    items = list(blocks)  # the units the split counts, in order
    if layout.account_for_embedding_in_pipeline_split:
        if blocks[0] == 0:
            raise LayoutError("account_for_embedding_in_pipeline_split: the model has nothing before its first "
                              "numbered block to count as the embedding")
        items.insert(0, 0)
    if layout.account_for_loss_in_pipeline_split:
        if blocks[-1] == len(units) - 1:
            raise LayoutError("account_for_loss_in_pipeline_split: the model has nothing after its last numbered "
                              "block to count as the loss")
        items.append(blocks[-1] + 1)
    sizes = stage_block_counts(len(items), layout)
    if min(sizes) < 1:
        raise LayoutError(f"pp x virtual_stages = {layout.pp} x {layout.virtual_stages} = {stages} stages, but the "
                          f"model has {len(blocks)} numbered blocks to split among them"
                          + (" (counting the embedding and the loss as blocks where asked)" if len(items) > len(blocks)
                             else "") + f" as asked (blocks per stage {sizes}): lower pp or virtual_stages, or give "
                          "the first and last stages fewer blocks")
    return [items[sum(sizes[:k])] for k in range(1, stages)]


def stage_block_counts(n: int, layout: Layout) -> list[int]:
    """Blocks per stage, in model order (stage k runs on rank k mod pp), for ``n`` blocks: the layout's
    first / last rank counts spread evenly over their virtual stages, the rest evenly over the other
    stages, extra blocks to the stages nearest the middle (``layout_stage_starts``).

    >>> from autoshard.layouts import megatron
    >>> stage_block_counts(10, megatron(pp=4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1))
    [1, 4, 4, 1]
    >>> stage_block_counts(128, megatron(pp=16, virtual_stages=8)) == [1] * 128   # Llama 3 405B, embedding and head counted
    True
    """
    pp, v = layout.pp, layout.virtual_stages
    stages = pp * v
    fixed = {0: layout.decoder_first_pipeline_num_layers, pp - 1: layout.decoder_last_pipeline_num_layers}
    fixed = {rank: count for rank, count in fixed.items() if count is not None}
    sizes = [0] * stages
    free = [k for k in range(stages) if k % pp not in fixed]
    for rank, count in fixed.items():
        own = [k for k in range(stages) if k % pp == rank]
        for k, size in zip(own, _even(count, len(own))):
            sizes[k] = size
    rest = n - sum(fixed.values())
    if rest < 0 or (rest > 0 and not free):
        raise LayoutError(f"decoder_first/last_pipeline_num_layers {sorted(fixed.values())} do not leave the other "
                          f"stages the model's remaining {rest} blocks: choose counts that add up to {n} or fewer")
    for k, size in zip(free, _even(rest, len(free))):
        sizes[k] = size
    return sizes


def _even(n: int, parts: int) -> list[int]:
    """``n`` split over ``parts`` in order, as evenly as possible, the extra ones to the parts nearest the
    middle."""
    if parts == 0:
        return []
    base, extra = divmod(n, parts)
    middle_first = sorted(range(parts), key=lambda k: (abs(2 * k - (parts - 1)), k))
    return [base + (k in middle_first[:extra]) for k in range(parts)]


def stamp_layout(solutions, layout: Layout) -> None:
    """Record ``layout.describe()`` in each solution's ``solver_stats["layout"]`` (the summary prints it)."""
    for solution in solutions:
        if solution is not None:
            solution.solver_stats["layout"] = layout.describe()


def published_layout_hints(captured: CapturedGraph, submesh: Mesh) -> list[Pins]:
    """The placements of the published layouts that fit a stage planner candidate's (dp, tp) ``submesh``,
    as pins on ``captured`` (``passes.sharding.pins.HintsFor``): Megatron's (replicated over dp, tensor
    and sequence parallel over tp, the residual stream sequence-split between blocks), the same with
    its distributed optimizer (parameters ``R/zero1`` over dp) and FSDP's (sharded over dp, the same
    over tp). The stage planner seeds each candidate's intra-op solve with them, so the candidate is
    never priced worse than these layouts of its shape. A layout the model cannot take (tp not dividing
    the heads or the sequence) gives no hint."""
    if submesh.ndim != 2:
        return []
    dp, tp = submesh.shape
    hints = []
    kinds = ((False, False), (False, True), (True, False)) if dp > 1 else ((False, False),)
    for sharded, zero1 in kinds:
        axes = LayoutAxes(replicate=() if sharded else (0,), shard=(0,) if sharded else (), tp=1, zero1=zero1)
        try:
            pins = layout_pins(captured, submesh, axes, sequence_parallel=tp > 1)
        except LayoutError:
            continue
        pins["ops"].update(_residual_stream_between_units(captured, pins["ops"]))
        hints.append(Pins(params=pins["params"], inputs=pins["inputs"], ops=pins["ops"]))
    return hints


def mesh_layout_hints(captured: CapturedGraph, mesh: Mesh) -> list[Pins]:
    """The placements of the published layouts without a pipeline that fit ``mesh`` as given (its axes
    in order, none folded), as pins on ``captured`` exactly as ``plan(layout=...)`` pins them
    (``layout_pins_and_levers``), for the planner's overlap re-rank (``passes.solve.layout_finalists``):
    data parallel over every axis (DDP: replicated; Megatron's distributed optimizer: ``R/zero1``;
    FSDP: sharded; with two axes or more HSDP: replicated over the first, sharded over the rest) and,
    tensor parallel over the last axis (sequence parallel where it is more than one device), the other
    axes data parallel (Megatron's, with and without its distributed optimizer; FSDP + TP, torchtitan's
    2D). Duplicates (a size-1 axis) are given once; a layout the model cannot take (tp not dividing the
    heads or the sequence) gives no hint."""
    every = tuple(range(mesh.ndim))
    rest, last = every[:-1], mesh.ndim - 1
    kinds = [LayoutAxes(replicate=every), LayoutAxes(replicate=every, zero1=True), LayoutAxes(shard=every)]
    if mesh.ndim >= 2:
        kinds.append(LayoutAxes(replicate=every[:1], shard=every[1:]))
    kinds += [LayoutAxes(replicate=rest, tp=last), LayoutAxes(replicate=rest, tp=last, zero1=True),
              LayoutAxes(shard=rest, tp=last)]
    hints: list[Pins] = []
    roles = tensor_parallel_roles(captured)
    for axes in kinds:
        try:
            pins = layout_pins(captured, mesh, axes, sequence_parallel=axes.tp is not None and mesh.shape[axes.tp] > 1,
                               roles=roles)
        except LayoutError:
            continue
        hint = Pins(params=pins["params"], inputs=pins["inputs"], ops=pins["ops"])
        if hint not in hints:
            hints.append(hint)
    return hints
