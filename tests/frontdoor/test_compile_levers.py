"""``autoshard.compile``'s lever arguments (``accumulation``, ``checkpoint``, ``reshard_after_forward``,
``mixed_precision``) in one process (a 1-device mesh): they reach the plan and the program, a step
matches one device doing the same, and bad values get clear errors before anything runs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.errors import AutoshardError, BatchError, PlanFormatError
from autoshard.runtime.regions import CheckpointRegion
from autoshard.testing.models import gpt


def _gpt(batch: int = 8):
    torch.manual_seed(0)
    model, _, _, loss_fn = gpt()
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (batch, 16), generator=g), torch.randint(0, 64, (batch, 16), generator=g)
    return model, ids, target, loss_fn


def test_lever_arguments_reach_the_plan_and_the_step_matches_one_device():
    model, ids, target, loss_fn = _gpt(16)
    ref = copy.deepcopy(model)
    cm = autoshard.compile(model, (1,), example_inputs=(ids,), loss_fn=loss_fn, example_target=target,
                           hardware="cpu", accumulation=2, checkpoint={"blocks.#": "selective"},
                           reshard_after_forward=True)
    levers = cm.plan.solution.levers
    assert levers.accumulation == 2 and levers.blocks["blocks.#"].checkpoint == "selective"
    assert levers.blocks["blocks.#"].reshard_after_forward
    assert cm.plan.captured.gm.graph.find_nodes(op="placeholder", target="ids")[0].meta["autoshard.meta"].shape \
        == (8, 16)  # traced at the microbatch
    assert sorted(m.block for m in cm.program.modules() if isinstance(m, CheckpointRegion)) == ["blocks.0", "blocks.1"]
    with torch.no_grad():
        evaluated = cm(ids, target=target).item()  # forward only: the mean over the 2 microbatches
    got = cm.step(ids, target=target)
    want = sum(loss_fn(ref(ids[i:i + 8]), target[i:i + 8]) / 2 for i in (0, 8))
    assert evaluated == pytest.approx(want.item(), rel=1e-5)
    want.backward()
    assert got == pytest.approx(want.item(), rel=1e-5)
    grads = dict(cm.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6), name


def test_mixed_precision_argument_traces_bf16_and_keeps_fp32_masters():
    model, ids, target, loss_fn = _gpt()
    cm = autoshard.compile(model, (1,), example_inputs=(ids,), loss_fn=loss_fn, example_target=target,
                           hardware="cpu", mixed_precision=autoshard.MixedPrecision(torch.bfloat16, torch.float32))
    dtypes = {n.meta["autoshard.meta"].dtype for n in cm.plan.captured.gm.graph.nodes
              if n.op == "placeholder" and n.name in cm.plan.captured.params}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in cm.parameters()} == {torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's model is untouched
    cm.step(ids, target=target)
    assert all(p.grad.dtype == torch.float32 for p in cm.parameters())


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"accumulation": 3}, BatchError, r"accumulation=3 cuts dim 0 into 3 equal microbatches"),
    ({"accumulation": 0}, TypeError, r"accumulation=0: pass an int >= 1"),
    ({"checkpoint": {"layers.#": "full"}}, PlanFormatError, r"names block type\(s\) \['layers.#'\]; this model's "
                                                             r"block types are \['blocks.#'\]"),
    ({"checkpoint": "partial"}, AutoshardError, r"checkpoint='partial': choose one of"),
    ({"reshard_after_forward": "yes"}, TypeError, r"reshard_after_forward= takes True/False"),
    ({"mixed_precision": "bf16"}, TypeError, r"mixed_precision= takes autoshard.MixedPrecision"),
])
def test_bad_lever_arguments_are_refused(kwargs, error, match):
    model, ids, target, loss_fn = _gpt()
    with pytest.raises(error, match=match):
        autoshard.compile(model, (1,), example_inputs=(ids,), loss_fn=loss_fn, example_target=target,
                          hardware="cpu", **kwargs)


def test_block_levers_need_blocks_and_dtypes_must_be_supported():
    x = torch.randn(8, 8)
    with pytest.raises(PlanFormatError, match="applies to repeated blocks .* this model has none"):
        autoshard.compile(_NoBlocks(), (1,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=x,
                          hardware="cpu", checkpoint="full")
    with pytest.raises(AutoshardError, match="mixed precision dtype torch.int8 is not supported"):
        autoshard.MixedPrecision(param_dtype=torch.int8)
