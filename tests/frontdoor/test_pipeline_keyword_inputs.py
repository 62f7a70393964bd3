"""Pipelines and Hugging Face models with keyword inputs.

``plan(pp=2)`` and ``compile(pp=2)`` take ``example_inputs`` as a dict of keyword tensors (cut along
dim 0 into microbatches like a tuple); a compiled pipeline's ``step`` takes the inputs by name;
``cm.plan.summary()`` prints a compiled pipeline as ``Plan.summary`` does; the CLI plans an
HF spec with ``--pp auto``. On 4 gloo ranks (two groups of two) an HF Llama with keyword inputs
trains like one device (loss every step, parameters after 3 AdamW steps).
"""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard import cli
from autoshard.passes.errors import BatchError
from autoshard.plans import load_plan
from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.models import hf_llama
from autoshard.testing.ranks import run_ranks


def _llama(device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model, inputs, target, loss_fn = hf_llama()
    return model, {k: v.to(device) for k, v in inputs.items()}, target.to(device), loss_fn


def test_plan_pp_2_takes_keyword_inputs():
    model, inputs, target, loss_fn = _llama("meta")
    plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu", pp=2, microbatches=2, time_limit_s=20)
    assert plan.pipelined and plan.pp == 2
    assert set(plan.param_placements) == {n for n, _ in model.named_parameters()}
    with pytest.raises(BatchError, match="tuple of tensors or a dict of keyword tensors"):
        autoshard.plan(model, (4,), example_inputs="ids", loss_fn=loss_fn, example_target=target, pp=2)
    with pytest.raises(BatchError, match="microbatches=3 cuts dim 0"):
        from autoshard.pipelines import microbatch_inputs
        microbatch_inputs(inputs, target, 3)


def test_cli_plans_an_hf_spec_with_pp_auto(tmp_path, capsys):
    out = tmp_path / "llama_pp.json"
    spec = ("llama:hidden_size=32,intermediate_size=64,num_hidden_layers=4,num_attention_heads=4,"
            "num_key_value_heads=2,vocab_size=64")
    assert cli.main(["plan", spec, "--mesh", "4", "--batch", "8", "--seq", "8", "--hardware", "h100",
                     "--pp", "auto", "--time-limit", "20", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = load_plan(out)
    assert isinstance(saved, autoshard.Plan)
    assert saved.summary().splitlines()[0] in printed


def keyword_worker(rank: int, world: int) -> list:

    torch.set_num_threads(1)
    model, inputs, target, loss_fn = _llama()
    cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                           hardware="cpu", pp=2, microbatches=2, time_limit_s=20)
    if not cm.plan.pipelined:
        return [f"hf_llama keyword inputs pp=2: got {type(cm).__name__}"]
    failures = []
    text = cm.plan.summary()
    if "pipelined plan" not in text or "2 microbatches" not in text or text.count("    stage ") != 2:
        failures.append(f"cm.plan.summary(): {text[:300]}")
    # the harness calls cm.step(target=..., **inputs): the inputs by name
    failures += train_against_one_device("hf_llama keyword inputs pp=2", cm, copy.deepcopy(model), (inputs, target),
                                         loss_fn=loss_fn, steps=3, tol=Tolerance(rtol=1e-4, atol=2e-5),
                                         optimizer=adamw(lr=1e-3))
    try:
        cm.step(input_idz=inputs["input_ids"], target=target)
        failures.append("a misspelt keyword input was accepted")
    except BatchError as e:
        if "input_idz" not in str(e):
            failures.append(f"misspelt keyword: {e}")
    return failures


@pytest.mark.slow  # an HF Llama planned, split and trained on 4 ranks: about 100 s on 2 loaded cores
def test_compile_pp_2_with_keyword_inputs_equals_one_device():
    failures = failures_of(run_ranks(keyword_worker, 4, timeout=400))
    assert not failures, "\n".join(failures)
