"""``compile=True`` on 4 gloo ranks, mesh (2, 2), against one device (slow tier: inductor compiles each
model's regions in C++ on first use).

The GPT, an HF Llama, a BatchNorm CNN (``BlockCNN``: BatchNorm in numbered blocks, statistics synchronized
across ranks by ``batch_norm_sync``) and an HF Mixtral (experts as one ``moe_experts`` op), each under the
solver's plan and a random plan, every block checkpointed and resharded after forward: two steps within
the measured noise floor (``zoo_check.TOL``, plain SGD, first-step gradients compared), in one spawn.
Every compiled region compiles; the GPT's and the Llama's with no graph break. And the GPT under the
other levers: 2 accumulation microsteps with "selective" checkpointing, and bf16 mixed precision, whose
losses must stay within bf16 rounding of the eager program's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard.runtime.compiled_regions import CompiledRegion
from autoshard.testing.equivalence import compiled_gradient_mismatches, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks
from autoshard.testing.zoo_check import TOL, sgd

CASES = [(name, seed) for name in ("gpt", "hf_llama", "cnn", "mixtral") for seed in (None, 5)]
NO_BREAKS = ("gpt", "hf_llama")


def _model(name: str):
    """(model, inputs, target, loss_fn, reference loss or None) seeded alike on every rank."""
    torch.manual_seed(0)
    if name == "mixtral":
        from autoshard.testing.hf_zoo import build as zoo
        model, inputs, target, loss_fn = zoo("mixtral")
        return model, inputs, target, loss_fn
    from autoshard.testing.levers import build
    model, batch, loss_fn, _ = build(name)
    inputs, target = batch(8, 0)
    return model, inputs, target, loss_fn


def _sweep(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    out = []
    for name, seed in CASES:
        label = f"{name} {'solver' if seed is None else f'random plan {seed}'}"
        model, inputs, target, loss_fn = _model(name)
        ref = copy.deepcopy(model)
        cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", random_seed=seed, checkpoint="full", reshard_after_forward=True,
                               compile=True, time_limit_s=10)
        failures = train_against_one_device(label, cm, ref, (inputs, target), loss_fn=loss_fn, steps=2, tol=TOL,
                                            optimizer=sgd, gradients=compiled_gradient_mismatches)
        regions = [m for m in cm.program.modules() if isinstance(m, CompiledRegion)]
        uncompiled = [r for r in regions if not r.stats.compiles]
        if not regions or uncompiled:
            failures.append(f"{label}: {len(uncompiled)} of {len(regions)} regions never compiled")
        breaks = sum(cm.compile_report.graph_breaks.values())
        if name in NO_BREAKS and breaks:
            failures.append(f"{label}: {breaks} graph breaks: {dict(cm.compile_report.graph_breaks)}")
        out.append((label, failures, len(regions), breaks, cm.compile_report.stats.seconds))
    return out


@pytest.mark.slow
def test_compiled_steps_equal_one_device_on_4_ranks():
    results = run_ranks(_sweep, 4, timeout=3600)
    failures = failures_of([f for per_rank in results for _, f, *_ in per_rank])
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
                                   hardware="cpu", random_seed=7, compile=compile_, **levers)
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
