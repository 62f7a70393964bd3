"""HF ``LlamaForCausalLM`` (tiny config) through pp=2 with microbatches of one sequence: its trace at
batch 1 differs from the global batch's (HF drops an ``expand`` building position ids), so the stage
cut is moved onto the microbatch trace by alignment and every stage re-solved there. Under 1F1B and
DualPipeV on 4 gloo ranks (two groups of two), training equals one device: loss at every step,
parameters after 3 AdamW steps; so does a DualPipeV plan saved by ``autoshard.plan`` at the global
batch and compiled from the file (its decisions moved onto the microbatch trace, nothing planned).
One spawn runs all three. Another program's trace is still refused."""
from __future__ import annotations

import copy

import pytest
import torch

from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.models import BATCH, hf_llama
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=2e-5)


def _build():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = hf_llama()
    return model, (inputs["input_ids"],), target, loss_fn


def one_sequence_worker(rank: int, world: int, schedules: list, saved: str) -> list:
    import autoshard

    torch.set_num_threads(1)
    failures = []
    for schedule in schedules + [saved]:
        label = f"hf_llama pp=2 {schedule}, microbatches of one sequence"
        model, inputs, target, loss_fn = _build()
        how = dict(plan=autoshard.load_plan(saved)) if schedule == saved else dict(
            hardware="cpu", pp=2, schedule=schedule, microbatches=BATCH, time_limit_s=20)
        schedule = "dualpipev" if schedule == saved else schedule
        try:
            cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                   **how)
        except autoshard.AutoshardError as e:
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if not cm.plan.pipelined or (cm.plan.schedule, cm.plan.microbatches) != (schedule, BATCH):
            failures.append(f"{label}: got {type(cm).__name__}")
            continue
        failures += train_against_one_device(label, cm, copy.deepcopy(model), (inputs, target), loss_fn=loss_fn,
                                             steps=3, tol=TOL, optimizer=adamw(lr=1e-3))
    return failures


def test_hf_llama_microbatch_of_one_sequence_equals_one_device(tmp_path):
    import autoshard
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.retrace import match_nodes
    from autoshard.passes.errors import PlanFormatError

    model, inputs, target, loss_fn = _build()
    full = capture(model, inputs, loss_fn=loss_fn, target=target)
    one = capture(model, tuple(x[:1] for x in inputs), loss_fn=loss_fn, target=target[:1])
    with pytest.raises(PlanFormatError):  # premise: the two traces differ op for op
        match_nodes(full, one)
    plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu",
                          pp=2, schedule="dualpipev", microbatches=BATCH, time_limit_s=20)
    saved = str(tmp_path / "llama_dualpipev.json")
    plan.save(saved)
    failures = failures_of(run_ranks(one_sequence_worker, 4, ["1f1b", "dualpipev"], saved, timeout=900))
    assert not failures, "\n".join(failures)


def test_retracing_moves_boundaries_by_alignment_and_refuses_another_program():
    import torch.nn.functional as F
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import PlanFormatError
    from autoshard.passes.pipeline.stages.retrace import retrace_stage_nodes
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    from autoshard.testing.models import unet

    model, inputs, target, loss_fn = _build()
    full = capture(model, inputs, loss_fn=loss_fn, target=target)
    one = capture(model, tuple(x[:1] for x in inputs), loss_fn=loss_fn, target=target[:1])
    moved = retrace_stage_nodes(full, one, stage_nodes_from_prefixes(full, ["model.layers.1"]))
    assert moved == stage_nodes_from_prefixes(one, ["model.layers.1"])
    other, x, t, _, _ = unet()
    with pytest.raises(PlanFormatError, match="differ in"):
        retrace_stage_nodes(full, capture(other, x, loss_fn=F.mse_loss, target=t),
                            [[n.name for n in full.gm.graph.nodes if n.op == "call_function"]])
