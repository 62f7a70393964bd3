"""Megatron-LM's fp32 main gradients (``layouts.megatron(accumulate_allreduce_grads_in_fp32=True)``, forced on
with ``--bf16``) priced through ``autoshard.plan(layout=)`` on a bf16 model: the gradient all-reduce (and
the distributed optimizer's reduce-scatter) moves fp32 bytes, every microbatch after the first adds its
bf16 gradient into an fp32 one (``accumulation_bytes(2, 4)``), and the gradients are held at 4 bytes per
element. ``compile`` refuses such a plan: its runtime accumulates in the parameters' dtype. Meta-device
models, one process."""
from __future__ import annotations

import json

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.layouts import LayoutError
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.kernel_classes import class_seconds
from autoshard.passes.cost.optimizer_step import accumulation_bytes
from autoshard.passes.errors import AutoshardError, PlanFormatError
from autoshard.plans import Plan
from autoshard.testing.models import GPT, lm_loss

BATCH, SEQ, DIM = 32, 128, 256


def _plan(mesh, **layout):
    x = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = GPT(256, DIM, 4, 4, SEQ, tied=False).to(torch.bfloat16)
    return autoshard.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, hardware="a100",
                          layout=layouts.megatron(microbatch_size=2, recompute="none", **layout), memory_limit=1e12)


def _syncs(solution):
    return {(fqn, i): c for fqn, calls in solution.param_grad_syncs.items() for i, c in enumerate(calls)}


def _both(mesh, **layout):
    return _plan(mesh, **layout), _plan(mesh, accumulate_allreduce_grads_in_fp32=True, **layout)


def test_data_parallel_reduces_accumulates_and_holds_fp32_gradients():
    off, on = _both((8,))  # dp 8, 2 microsteps of 2 sequences
    k = off.solution.levers.accumulation
    assert k == on.solution.levers.accumulation == 2
    assert on.solution.strategies == off.solution.strategies  # the same plan, priced with fp32 gradients
    syncs_off, syncs_on = _syncs(off.solution), _syncs(on.solution)
    assert syncs_off and syncs_on.keys() == syncs_off.keys()
    assert all(syncs_on[key].bytes == 2 * c.bytes and syncs_on[key].kind == c.kind for key, c in syncs_off.items())
    assert on.solution.time_breakdown["grad_sync"] > off.solution.time_breakdown["grad_sync"]
    # every parameter replicated: each rank accumulates every element, (k - 1) times per step
    elements = sum(p.numel() for p in GPT(256, DIM, 4, 4, SEQ, tied=False).parameters())
    hw = PRESETS["a100"]
    added = (k - 1) * (class_seconds(hw, "elementwise", elements * accumulation_bytes(2, 4))
                       - class_seconds(hw, "elementwise", elements * accumulation_bytes(2, 2)))
    extra = on.solution.time_breakdown["compute"] - off.solution.time_breakdown["compute"]
    assert extra == pytest.approx(added, rel=1e-6)
    assert on.solution.memory_breakdown["grads"] == 2 * off.solution.memory_breakdown["grads"] == 4 * elements
    assert on.estimated_memory - off.estimated_memory == pytest.approx(2 * elements, rel=1e-9)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distributed-optimizer"])
def test_pipelined_stages_reduce_and_hold_fp32_gradients(distributed_optimizer):
    off, on = _both((8,), tp=2, pp=2, sequence_parallel=False, distributed_optimizer=distributed_optimizer)
    assert off.pipelined and on.pipelined and off.microbatches == on.microbatches
    for s_off, s_on in zip(off.stages, on.stages):
        a, b = s_off.solution, s_on.solution
        assert b.param_placements == a.param_placements
        assert b.levers.mixed_precision is not None and b.levers.mixed_precision.accumulate_in_reduce_dtype
        syncs_off, syncs_on = _syncs(a), _syncs(b)
        kinds = {c.kind for c in syncs_off.values()}
        assert kinds == ({"all_reduce", "reduce_scatter"} if distributed_optimizer else {"all_reduce"})
        assert all(syncs_on[key].bytes == 2 * c.bytes for key, c in syncs_off.items())
        # bf16 gradients (the reduced slices and, ZeRO-1, the whole ones held over the microbatches) held in fp32
        elements = a.memory_breakdown["grads"] / 2
        assert b.memory_breakdown["grads"] == 4 * elements
        assert b.estimated_memory - a.estimated_memory == pytest.approx(2 * elements, rel=1e-9)
        assert b.time_breakdown["grad_sync"] > a.time_breakdown["grad_sync"]
    assert on.estimated_step_time > off.estimated_step_time


def test_the_flag_is_megatrons_text_and_json_and_off_by_default():
    layout = layouts.megatron(tp=4, pp=12, distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True)
    assert "accumulate_allreduce_grads_in_fp32=True" in layout.describe()
    assert layouts.parse(layout.describe()) == layout and layouts.Layout.from_json(layout.to_json()) == layout
    assert "accumulate_allreduce_grads_in_fp32" not in layouts.megatron(tp=4, pp=12).describe()
    with pytest.raises(LayoutError, match="accumulate_allreduce_grads_in_fp32 is Megatron-LM's option"):
        layouts.Layout("fsdp", accumulate_allreduce_grads_in_fp32=True)
    with pytest.raises(AutoshardError, match="give reduce_dtype="):
        autoshard.MixedPrecision(accumulate_in_reduce_dtype=True)


def test_compile_refuses_a_plan_with_fp32_main_gradients():
    plan = Plan.from_json(json.loads(json.dumps(_plan((8,), accumulate_allreduce_grads_in_fp32=True).to_json())))
    assert plan.solution.levers.mixed_precision.accumulate_in_reduce_dtype  # a saved plan keeps it
    with torch.device("meta"):
        model = GPT(256, DIM, 4, 4, SEQ, tied=False).to(torch.bfloat16)
    x = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with pytest.raises(PlanFormatError, match=r"accumulate_allreduce_grads_in_fp32.*does not run.*"
                                              r"MixedPrecision\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32\)"):
        autoshard.compile(model, plan.mesh.shape, example_inputs=(x,), loss_fn=lm_loss, example_target=x, plan=plan)
