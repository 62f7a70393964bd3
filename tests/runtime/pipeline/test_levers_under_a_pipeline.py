"""Every memory lever under a pipeline, trained on 4 gloo ranks against one device.

A plan is a list of stages and every stage runs the full lowered program (``runtime.stage``), so the
levers a plan without a pipeline has work per stage of a pipeline too (``pp=2`` on a (4,) mesh: two
rank groups of two ranks, data parallel or FSDP inside each):

- ``plan(pp=2, checkpoint="full")``: every stage's Solution carries the policy, its program runs its
  blocks as checkpoint regions (here under zb-h1, whose split backward recomputes a region for B and
  again for W); the plan is saved, loaded and compiled with nothing planned again;
- ``compile(pp=2, reshard_after_forward=...)`` with the stages' parameters pinned ``S(0)`` (FSDP
  inside each rank group): the parameter groups free their gathered copies after the forward and
  gather them again for the backward (True), or keep them (False);
- ``compile(pp=2, accumulation=2)``: the schedule runs twice per step, each round on half of the
  batch cut into the plan's microbatches; the step still computes the one-device full-batch mean loss.

For a GPT with tied embeddings and a Hugging Face Llama: the loss of every step, every local gradient
of the first step (before AdamW could hide a scale error) and the full parameters after 2 steps match
one device. Each premise (the lever is in the plan and in the program that runs) is checked, so a
lever silently dropped fails.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

import autoshard
from autoshard.testing.equivalence import (Tolerance, adamw, failures_of, pipeline_gradient_mismatches,
                                           train_against_one_device)
from autoshard.testing.models import gpt_pipeline, hf_llama
from autoshard.testing.ranks import run_ranks

FSDP = {"*": ("S(0)", "R")}  # per axis of a stage's (dp, tp) = (2, 1) submesh


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        model, inputs, target, loss_fn, _ = gpt_pipeline(n_layer=4)
        return model, inputs, target, loss_fn
    return hf_llama()


def _premises(label: str, cm, case: dict) -> list[str]:
    """What the case's lever must have changed, in the plan that runs and in this rank's program."""
    from autoshard.runtime.regions import CheckpointRegion
    plan, program = cm.plan, cm._program
    if not plan.pipelined or plan.pp != 2:
        return [f"{label}: premise: no pipeline of 2 rank groups ({len(plan.stages)} stages)"]
    out = []
    lever = case["lever"]
    for stage in program.stages.values():
        levers = stage.levers
        if "checkpoint" in lever:
            regions = [m for m in stage.program.modules() if isinstance(m, CheckpointRegion)]
            if not regions or any(p.checkpoint != "full" for p in levers.blocks.values()):
                out.append(f"{label}: stage {stage.index} runs no checkpointed block ({levers})")
        if "reshard_after_forward" in lever:
            groups = stage.gatherer.groups if stage.gatherer is not None else []
            want = lever["reshard_after_forward"]
            if not groups or any(g.reshard != want for g in groups if g.block is not None):
                out.append(f"{label}: stage {stage.index}'s parameter groups do not reshard={want}: "
                           f"{[(g.block, g.reshard) for g in groups]}")
    if "accumulation" in lever:
        from autoshard.passes.graph import META
        captured = program.captured
        rows = captured.node(captured.inputs[0]).meta[META].shape[0]
        if plan.accumulation != 2 or program.rounds != 2 or rows * 2 * plan.microbatches != 8:
            out.append(f"{label}: accumulation {plan.accumulation}, rounds {program.rounds}, traced rows {rows}")
    return out


CASES = [
    {"label": "plan(pp=2, checkpoint='full') under zb-h1", "saved": True,
     "lever": {"checkpoint": "full"}, "kw": {"schedule": "zb-h1", "microbatches": 2}},
    {"label": "compile(pp=2, reshard_after_forward=True), FSDP stages",
     "lever": {"reshard_after_forward": True}, "kw": {"schedule": "1f1b", "microbatches": 2, "params": FSDP}},
    {"label": "compile(pp=2, reshard_after_forward=False), FSDP stages",
     "lever": {"reshard_after_forward": False}, "kw": {"schedule": "1f1b", "microbatches": 2, "params": FSDP}},
    {"label": "compile(pp=2, accumulation=2)", "lever": {"accumulation": 2},
     "kw": {"schedule": "1f1b", "microbatches": 2}},
]


def lever_worker(rank: int, world: int, name: str, saved: dict) -> list:
    failures = []
    for case in CASES:
        label = f"{name}, {case['label']}"
        model, inputs, target, loss_fn = build(name)
        common = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu",
                      time_limit_s=10)
        if case.get("saved"):
            plan = autoshard.Plan.from_json(saved[case["label"]])
            cm = autoshard.compile(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                   plan=plan)
        else:
            kw = {k: v for k, v in case["kw"].items()}
            cm = autoshard.compile(model, (4,), pp=2, **kw, **case["lever"], **common)
        premise = _premises(label, cm, case)
        if premise:
            failures += premise
            continue
        failures += train_against_one_device(
            label, cm, copy.deepcopy(model), (inputs, target), loss_fn=loss_fn, steps=2,
            tol=Tolerance(rtol=1e-4, atol=2e-5, grad_atol=2e-6), optimizer=adamw(eps=1e-6),
            check_gradients=lambda prog, ref, label=label: pipeline_gradient_mismatches(
                label, prog, ref, Tolerance(rtol=1e-4, atol=2e-5, grad_atol=2e-6)))
    return failures


def _saved_plans(name: str) -> dict:
    """The plans the ``saved`` cases compile, made here with no process group and sent as JSON."""
    out = {}
    for case in CASES:
        if case.get("saved"):
            model, inputs, target, loss_fn = build(name)
            plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                  hardware="cpu", time_limit_s=10, pp=2, **case["kw"], **case["lever"])
            assert plan.pipelined and all(
                s.solution.levers.blocks and all(p.checkpoint == "full" for p in s.solution.levers.blocks.values())
                for s in plan.stages), f"premise: {name}: plan(pp=2, checkpoint='full') records the lever per stage"
            out[case["label"]] = json.loads(json.dumps(plan.to_json()))
    return out


def test_levers_under_a_pipeline_train_a_gpt_like_one_device():
    failures = failures_of(run_ranks(lever_worker, 4, "gpt", _saved_plans("gpt"), timeout=900))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_levers_under_a_pipeline_train_hf_llama_like_one_device():
    failures = failures_of(run_ranks(lever_worker, 4, "llama", _saved_plans("llama"), timeout=900))
    assert not failures, "\n".join(failures)
