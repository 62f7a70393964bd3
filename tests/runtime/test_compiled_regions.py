"""What ``compile=`` makes of a rank's program (``runtime/compiled_regions.py``), built in one process on a
fake process group of 4 ranks (``torch.testing``'s "fake" backend: collectives do nothing), nothing run.

- every ATen op of a random (2, 2) plan with checkpointing and reshard-after-forward ends up inside
  a compiled region, its collectives inside as functional collectives; outside the regions stay only
  the parts the report names (parameter gathers, ring attention), this rank's slices of the inputs,
  the checkpoint wrappers and the partitions between them;
- a data-parallel program is one region: the whole forward (and so its backward) in one graph;
- ``compile=`` is checked at the front door.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import autoshard
from autoshard.runtime import collectives as C
from autoshard.runtime import functional_collectives as FC
from autoshard.runtime.compiled_regions import CompiledRegion
from autoshard.runtime.param_gather import gather_params
from autoshard.runtime.regions import CheckpointRegion
from autoshard.runtime.ring_attention import ring_attention
from autoshard.testing.levers import build

FAST = autoshard.CompileOptions(backend="aot_eager")


def _compiled(mesh, rank: int = 0, **options):
    """Rank ``rank``'s compiled model of the GPT under ``plan(**options)`` (planned here, not broadcast)."""
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(8, 0)
    kw = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
    plan = autoshard.plan(model, mesh, **kw, **options)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        return autoshard.compile(model, mesh, plan=plan, compile=FAST, **kw)
    finally:
        dist.destroy_process_group()


def _graphs_outside_regions(program: fx.GraphModule) -> list:
    """The program's top graph, its partitions and its checkpointed bodies (not the compiled bodies)."""
    out = [program]
    for module in program.modules():
        if isinstance(module, CheckpointRegion):
            out.append(module.body)
        elif isinstance(module, fx.GraphModule) and module is not program and not any(
                r.body is module for r in program.modules() if isinstance(r, CompiledRegion)):
            out.append(module)
    return out


@pytest.mark.parametrize("rank", [0, 3])
def test_every_op_of_a_random_plan_is_compiled_between_gathers_and_checkpoints(rank):
    cm = _compiled((2, 2), rank, random_seed=3, checkpoint="full", reshard_after_forward=True)
    program = cm.program
    regions = [m for m in program.modules() if isinstance(m, CompiledRegion)]
    assert sorted(m.block for m in program.modules() if isinstance(m, CheckpointRegion)) == ["blocks.0", "blocks.1"]
    assert {r.where for r in regions} == {None, "blocks.0", "blocks.1"}  # inside the checkpointed blocks too
    left = [n for g in _graphs_outside_regions(program) for n in g.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]
    slices = [n for n in left if n.target in (FC.chunk, FC.to_partial)]  # this rank's piece of an input
    assert all(n.args[0].op == "placeholder" for n in slices)
    assert {n.target for n in left if n not in slices} == {gather_params, ring_attention}, \
        sorted({str(n.target) for n in left})
    inside = [n.target for r in regions for n in r.body.graph.nodes if n.op == "call_function"]
    assert not set(inside) & set(C.COLLECTIVES.values())  # no eager collective anywhere
    assert {FC.all_gather, FC.all_to_all} <= set(inside)
    assert sum(isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" for t in inside) > 40
    lines = "\n".join(cm.plan.summary().splitlines())
    assert "compiled (torch.compile, aot_eager)" in lines and "they compile at the first step" in lines
    assert "eager between regions: 4 x parameter gathers" in lines and "x ring_attention (ring attention" in lines
    assert cm.collective_counts()["all_to_all"] > 0  # counted inside the regions as before


def test_a_data_parallel_program_is_one_region():
    cm = _compiled((4,), **autoshard.presets.data_parallel((4,)))
    regions = [m for m in cm.program.modules() if isinstance(m, CompiledRegion)]
    assert len(regions) == 1
    top = [n.target for n in cm.program.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert set(top) == {FC.chunk} and not cm.compile_report.eager  # this rank's rows of the batch
    ops = [n for n in regions[0].body.graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in ops)
    assert any(n.target is torch.ops.aten.cross_entropy_loss.default for n in ops)


@pytest.mark.parametrize("value, match", [
    ("yes", r"compile='yes': pass True"),
    (autoshard.CompileOptions, r"compile=<class"),
])
def test_bad_compile_values_are_refused(value, match):
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(8, 0)
    with pytest.raises(TypeError, match=match):
        autoshard.compile(model, (1,), example_inputs=inputs, loss_fn=loss_fn, example_target=target, compile=value)


def test_compile_options_are_checked_and_plan_refuses_them():
    with pytest.raises(TypeError, match=r"backend='tvm'\): choose one of \['inductor', 'aot_eager', 'eager'\]"):
        autoshard.CompileOptions(backend="tvm")
    with pytest.raises(TypeError, match=r"mode='fast'\): a mode is inductor's"):
        autoshard.CompileOptions(mode="fast")
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(8, 0)
    kw = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
    with pytest.raises(TypeError, match=r"compile= is taken by autoshard.compile only"):
        autoshard.plan(model, (2,), compile=True, **kw)


def test_data_parallel_regions_are_cut_at_gradient_buckets():
    """As torch's DDP cuts compiled graphs at its buckets: each region's backward hands its gradients to
    their bucket while the earlier regions' backward still runs."""
    from autoshard.runtime.executor import RankProgram
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(8, 0)
    plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu",
                          **autoshard.presets.data_parallel((4,)))
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        cap_mb = 0.02  # the small GPT's 2 blocks hold about 0.1 MB of parameters
        rp = RankProgram(plan, model=model, bucket_mb=cap_mb, compile=FAST)
    finally:
        dist.destroy_process_group()
    regions = [m for m in rp.program.modules() if isinstance(m, CompiledRegion)]
    assert len(regions) >= 4
    sizes = {ph: p.numel() * p.element_size() for ph, p in zip(rp._only().param_names, rp.parameters())}
    seen = set()
    for region in regions:
        first = {n.name for n in region.body.graph.nodes if n.op == "placeholder" and n.name in sizes} - seen
        seen |= first
        assert sum(sizes[ph] for ph in first) <= cap_mb * 2**20 or len(first) == 1, first
    assert seen == set(sizes)
