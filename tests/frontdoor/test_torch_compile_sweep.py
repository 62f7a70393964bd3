"""``compile=`` on 4 gloo ranks, mesh (2, 2), against one device (slow tier: dynamo traces every region of
every case, and inductor compiles one case's in C++).

The GPT, an HF Llama, a BatchNorm CNN (``BlockCNN``: BatchNorm in numbered blocks, statistics synchronized
across ranks by ``batch_norm_sync``) and an HF Mixtral (experts as one ``moe_experts`` op), each under the
solver's plan and a random plan, every block checkpointed and resharded after forward: two steps within
the measured noise floor (``zoo_check.TOL``, plain SGD, first-step gradients compared), in one spawn
(``autoshard.testing.compile_check``). The GPT under the solver's plan goes through inductor, the other
cases through AOTAutograd without code generation (``aot_eager``: the same capture, functional collectives
and joint-graph autograd, without minutes of C++ compiles); ``benchmarks/compile_exactness.py`` runs every
case through inductor and prints the figures. Every compiled region compiles; the GPT's and the Llama's
with no graph break. And the GPT under the other levers (``aot_eager``): 2 accumulation microsteps with
"selective" checkpointing, and bf16 mixed precision, whose losses must stay within bf16 rounding of the
eager program's.
"""
from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.testing.compile_check import CASES, compile_worker
from autoshard.testing.ranks import run_ranks


@pytest.mark.slow
def test_compiled_steps_equal_one_device_on_4_ranks():
    results = run_ranks(compile_worker, 4, CASES, timeout=3600)
    failures = sorted({f for per_rank in results for r in per_rank for f in r.failures})
    assert not failures, "\n".join(failures)


def _levers(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    from autoshard.testing.levers import build
    out = []
    for levers in ({"accumulation": 2, "checkpoint": "selective", "reshard_after_forward": True},
                   {"mixed_precision": autoshard.MixedPrecision(torch.bfloat16, torch.float32)}):
        losses = []
        for compile_ in (False, True):
            torch.manual_seed(0)
            model, batch, loss_fn, _ = build("gpt")
            inputs, target = batch(16, 0)
            cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                   hardware="cpu", random_seed=7,
                                   compile=compile_ and autoshard.CompileOptions(backend="aot_eager"), **levers)
            opt = torch.optim.SGD(cm.parameters(), lr=0.1)
            run = []
            for step in range(2):
                run.append(cm.step(*inputs, target=target))
                opt.step()
                opt.zero_grad()
            losses.append(run)
        out.append((sorted(levers), losses, cm.compile_report.lines()))
    return out


@pytest.mark.slow
def test_accumulation_selective_checkpointing_and_mixed_precision_compiled():
    for per_rank in run_ranks(_levers, 4, timeout=3600):
        for levers, (eager, compiled), lines in per_rank:
            rel = 2e-2 if "mixed_precision" in levers else 1e-5  # bf16 rounding, or float32's
            assert compiled == pytest.approx(eager, rel=rel), (levers, eager, compiled)
            if "accumulation" in levers:
                assert any("checkpoint 'selective'" in line for line in lines), lines
