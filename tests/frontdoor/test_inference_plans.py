"""Forward-only plans: ``loss_fn=None`` plans and compiles an inference program.

The plan counts no gradients, no optimizer state and no backward pass (no gradient all-reduce, no
backward collectives); compiled on 4 gloo ranks, ``cm(x)`` returns the full output, equal to the
model's, no gradient buffers exist (measured: no parameter gets a ``.grad``, the program has no
gradient all-reduce), and the local parameter bytes match the plan's estimate.
"""
from __future__ import annotations

import torch

import autoshard
from autoshard.testing.models import mlp
from autoshard.testing.ranks import run_ranks


def test_a_plan_without_a_loss_counts_no_gradients_or_optimizer_state():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = mlp()
    training = autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                              hardware="h100")
    inference = autoshard.plan(model, (2, 2), example_inputs=inputs, hardware="h100")
    assert training.solution.memory_breakdown["grads"] > 0 and training.solution.memory_breakdown["optimizer"] > 0
    assert inference.solution.memory_breakdown["grads"] == 0 and inference.solution.memory_breakdown["optimizer"] == 0
    assert inference.solution.time_breakdown["grad_sync"] == 0
    assert not [c for r in inference.solution.redistributions for c in r.collectives if c.phase == "bwd"]
    assert not any(inference.solution.param_grad_syncs.values())


def inference_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, inputs, _, _ = mlp()
    cm = autoshard.compile(model, (2, 2), example_inputs=inputs, hardware="cpu",
                           params={"fc1.weight": ("R", "S(0)"), "fc2.weight": ("R", "S(1)")})
    out = cm(*inputs)
    with torch.no_grad():
        want = model(*inputs)
    measured = sum(p.numel() * p.element_size() for p in cm.parameters())
    return {"close": torch.allclose(out, want, rtol=1e-5, atol=1e-6), "shape": tuple(out.shape),
            "grads": [p.grad is not None for p in cm.parameters()], "counts": cm.collective_counts(),
            "measured": measured, "estimated": cm.plan.solution.memory_breakdown["params"]}


def test_an_inference_program_returns_the_full_output_and_keeps_no_gradients():
    for r in run_ranks(inference_worker, 4, timeout=180):
        assert r["close"] and r["shape"] == (8, 16)
        assert not any(r["grads"]) and "grad_sync" not in r["counts"]
        assert r["measured"] == r["estimated"]  # the MLP has no buffers; every rank holds the same bytes
