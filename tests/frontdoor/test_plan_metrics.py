"""Throughput and MFU of a plan (``passes/pipeline/plan_work.py``), with and without a pipeline.

Model FLOPs are counted by hand here for a model whose matmuls are known (two Linear layers, and
the GPT's attention and projections), and compared with ``plan.model_flops`` (matmul FLOPs x3 for a
training step, x1 without a loss); tokens per second per device, samples per second per device and
MFU follow from the plan's own step time, device count and the preset's dense peak. The numbers
survive save/load, and every summary prints them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.cost.hardware import PRESETS
from autoshard.testing.models import gpt


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_two_linears_count_and_rates(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    plan = autoshard.plan(TwoLinear(), (4,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                          hardware="h100")
    forward = 2 * 8 * 32 * 64 + 2 * 8 * 64 * 16
    assert plan.model_flops == 3 * forward
    step = plan.estimated_step_time
    assert plan.tokens_per_second_per_device is None  # float features: no token ids
    assert plan.samples_per_second_per_device == pytest.approx(8 / step / 4)
    assert plan.mfu == pytest.approx(3 * forward / (step * 4 * PRESETS["h100"].flops_fp32))
    text = plan.summary()
    assert "samples/s per device" in text and f"MFU {100 * plan.mfu:.1f}%" in text
    plan.save(str(tmp_path / "p.json"))
    loaded = autoshard.load_plan(str(tmp_path / "p.json"))
    assert loaded.mfu == pytest.approx(plan.mfu) and loaded.model_flops == plan.model_flops
    # forward only: the FLOPs of one pass
    inference = autoshard.plan(TwoLinear(), (4,), example_inputs=(x,), hardware="h100")
    assert inference.model_flops == forward


def test_gpt_counts_attention_and_reports_tokens():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(vocab=64, d=32, n_layer=2, n_head=4, seq=16)  # batch 8
    plan = autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu")
    b, s, d, v, layers = 8, 16, 32, 64, 2
    per_block = 2 * b * s * d * d * 4 + 2 * b * s * d * (4 * d) * 2 + 2 * b * s * s * (d + d)  # q,k,v,o; MLP; SDPA
    forward = layers * per_block + 2 * b * s * d * v  # the tied LM head
    assert plan.model_flops == pytest.approx(3 * forward)
    assert plan.tokens_per_second_per_device == pytest.approx(b * s / plan.estimated_step_time / 4)
    assert "tokens/s per device" in plan.summary()


def test_an_accumulation_plan_counts_the_whole_step():
    """A plan of k microsteps runs the global batch in a step: its FLOPs, tokens and samples are the
    step's, k times its program's (one microstep), so throughput and MFU are not k times too low."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt()
    one = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                         hardware="h100", accumulation=1)
    four = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="h100", accumulation=4)
    assert four.solution.levers.accumulation == 4
    assert four.work.tokens == one.work.tokens == inputs[0].numel()
    assert four.work.samples == one.work.samples and four.model_flops == pytest.approx(one.model_flops)
    assert four.tokens_per_second_per_device == pytest.approx(inputs[0].numel() / four.estimated_step_time / 4)
