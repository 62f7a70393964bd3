"""The logical mesh a layout runs on, and what each of its axes carries (``Layout.planning_mesh``).

The ranks of one pipeline stage are cut into axes where the attention's groups (tp fastest, then cp,
then dp, HSDP replicas slowest) or the experts' (etp, then ep, then expert dp) start
(``passes.sharding.expert_layout.fold_axes``: Megatron-Core's parallel folding); axes of size 1 are
dropped. Without a pipeline that is the planning mesh:

>>> from autoshard import layouts
>>> mesh, axes = single_stage_mesh(layouts.megatron(tp=2, ep=4, etp=1), 16)
>>> mesh                   # dp = 8: 4 expert-dp groups of ep = 4 ranks, each 2 dp ranks x the 2 tp ranks
Mesh(shape=(4, 2, 2), axis_names=('dp_edp', 'dp_ep', 'tp_ep'))
>>> axes.replicate, axes.tp, axes.experts.ep
((0, 1), 2, (1, 2))

With a pipeline, the stage planner cuts the planning mesh's first axis into ``pp`` groups of
consecutive ranks; each group's submesh is the stage's fold (``stage_submesh``). A layout without
expert groups of its own and without cp keeps the (dp, tp) submesh pipelined layouts always had.
"""
from __future__ import annotations

from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.expert_layout import Fold, expert_axes, fold_axes
from autoshard.passes.sharding.layout_placements import LayoutAxes

__all__ = ["single_stage_mesh", "stage_submesh", "folded"]


def folded(layout) -> bool:
    """Whether ``layout`` gives its experts groups of their own (ep > 1, or etp other than tp)."""
    return layout.ep > 1 or (layout.etp is not None and layout.etp != layout.tp)


def _fold(layout, world: int) -> Fold:
    dp = layout.data_parallel(world)
    return fold_axes(layout.tp, layout.cp, dp, layout.ep, layout.etp,
                     layout.replicas if layout.kind == "fsdp" else 1).without_ones()


def _axes(fold: Fold, replicate_dp: bool, with_experts: bool, zero1: bool = False) -> LayoutAxes:
    att = fold.attention
    replicate = tuple(i for i, a in enumerate(att) if a == "replica" or (a == "dp" and replicate_dp))
    shard = tuple(i for i, a in enumerate(att) if a == "dp" and not replicate_dp and fold.shape[i] > 1)
    if not shard and not replicate_dp and "dp" in att:  # a size-1 dp axis splits nothing: it replicates
        replicate += tuple(i for i, a in enumerate(att) if a == "dp" and i not in replicate)
    return LayoutAxes(replicate=tuple(sorted(replicate)), shard=shard,
                      cp=att.index("cp") if "cp" in att else None, tp=att.index("tp") if "tp" in att else None,
                      experts=expert_axes(fold, shard_data=bool(shard)) if with_experts else None,
                      zero1=zero1 and bool(replicate))


def single_stage_mesh(layout, world: int) -> tuple[Mesh, LayoutAxes]:
    """The planning mesh of a layout without a pipeline, and its axes' roles."""
    fold = _fold(layout, world)
    megatron = layout.kind == "megatron"
    return Mesh(fold.shape, fold.names), _axes(fold, megatron, folded(layout), megatron and layout.distributed_optimizer)


def stage_submesh(layout, world: int) -> tuple[Mesh, LayoutAxes]:
    """On a mesh of ``world`` devices (every stage's), one pipeline stage's submesh (at least 2 axes: a size-1 "tp" axis is appended to a lone one) and
    its axes' roles. Over data-parallel axes Megatron replicates (its distributed optimizer: ZeRO-1,
    the optimizer state sharded there) and FSDP shards."""
    dp = layout.data_parallel(world)
    replicate_dp = layout.kind == "megatron"
    if not folded(layout) and layout.cp == 1:  # the (dp, tp) submesh pipelined layouts always had
        fold = Fold((dp, layout.tp), ("dp", "tp"), ("dp", "tp"), ("edp", "etp"))
    else:
        fold = _fold(layout, world)
        if len(fold.shape) == 1:
            fold = Fold(fold.shape + (1,), fold.names + ("tp",), fold.attention + ("tp",), fold.experts + ("etp",))
    return Mesh(fold.shape, fold.names), _axes(fold, replicate_dp, folded(layout),
                                               replicate_dp and layout.distributed_optimizer)
