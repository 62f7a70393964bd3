"""Opaque calls (``passes.capture.opaque``): a custom autograd.Function and a data-dependent loss are each
captured as one ``autoshard::opaque`` op that runs the user's code, so the Function's own backward and
the loss as written are what the program computes (issue 31, items 1 and 3)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.batch_coupling import batch_coupled_ops
from autoshard.passes.capture.export import capture
from autoshard.passes.capture.opaque import OPAQUE
from autoshard.passes.errors import TraceError
from autoshard.testing.opaque_models import ctc_model, ste_mlp


def _ops(captured) -> list:
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"]


def _run_captured(captured, model, inputs, target):
    """Loss and parameter gradients of the captured graph run as it is (the op's own autograd formula)."""
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    loss = captured.gm(*params, *model.buffers(), *inputs, target)
    loss.backward()
    return loss, [p.grad for p in params]


def test_a_custom_function_is_one_opaque_op_whose_own_backward_runs():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = ste_mlp()
    apply_before = torch.autograd.Function.__dict__["apply"]
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    assert torch.autograd.Function.__dict__["apply"] is apply_before  # put back after the trace
    ops = _ops(captured)
    assert sum(n.target is OPAQUE for n in ops) == 2
    assert not any("round" in str(n.target) for n in ops), "the Function's forward was traced through"

    loss, grads = _run_captured(captured, model, inputs, target)
    want = loss_fn(model(*inputs), target)
    want.backward()
    assert torch.allclose(loss, want)
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(g, p.grad, atol=1e-6)
    assert model.fc1.weight.grad.abs().sum() > 0  # the identity backward reaches the first layer


def test_a_loss_with_data_dependent_internals_runs_as_written():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = ctc_model()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    opaque = [n for n in _ops(captured) if n.target is OPAQUE]
    assert len(opaque) == 1 and str(opaque[0].args[0]).startswith("loss_fn ctc_loss_of_logits")
    assert captured.loss_output
    loss, grads = _run_captured(captured, model, inputs, target)
    want = loss_fn(model(*inputs), target)
    want.backward()
    assert torch.allclose(loss, want)
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_data_dependent_forward_is_still_an_error():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # data-dependent control flow in the model, not the loss

    with pytest.raises(TraceError):
        capture(Branchy(), (torch.randn(4, 3),), loss_fn=lambda out, y: F.mse_loss(out, y), target=torch.randn(4, 3))


def test_opaque_calls_plan_on_the_meta_device_replicated_and_batch_coupled():
    torch.manual_seed(0)
    with torch.device("meta"):
        model, _, _, loss_fn = ste_mlp()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    plan = autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=loss_fn, example_target=y, hardware="cpu",
                          time_limit_s=5)
    assert plan.replicated_ops == ["autoshard.opaque.default"]  # both calls, run whole on every device
    coupled = batch_coupled_ops(capture(copy.deepcopy(ste_mlp()[0]), (x,), loss_fn=loss_fn, target=y))
    assert [c.why for c in coupled if "opaque call (autograd.Function" in c.why and "StraightThrough" in c.why]
