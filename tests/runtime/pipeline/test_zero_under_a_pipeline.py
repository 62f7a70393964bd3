"""ZeRO-1 and ZeRO-2 under a pipeline (``pp=2`` on a (4,) mesh: two rank groups of two ranks, each
stage's parameters in a ZeRO form over its data axis) match one device.

``autoshard.compile(pp=2, params={"*": ("R/zero1",)})`` (and ``zero2``): every stage's Solution
stores its parameters ``R/zero1`` (the pins reach the stage solves, ``stage_zero``), and each rank's
stages reduce-scatter their gradients and all-gather their parameters through one ``ZeroSync`` per
stage (``runtime.zero``): ``zero2`` around every weight action (each microbatch's BW, or a
zero-bubble W, whose gradients land without autograd's hooks), ``zero1`` after the stage's last one
of the step. Cases: replicated stages (the baseline), ``zero1`` with accumulation 2 under 1F1B (two
rounds of two microbatches: one reduction per step), ``zero2`` under ZB-H1 (four reduce-scatters per
bucket per step, held sharded between microbatches). For a GPT with tied embeddings (wte on stage 0
and the LM head's copy on stage 1: their slices' gradients are summed across the groups) and, in
the slow tier, an HF Llama:

- the loss of every step and every parameter after 3 AdamW steps equal one device's;
- the optimizer state measured on each rank (bytes of AdamW's moments) is 1/2 (1/dp) of the same
  rank's replicated run's, and the parameters it steps are slices of half the stage's;
- the collectives ``runtime.zero`` called on each rank in 3 steps (``RankProgram.zero_calls``; the
  last all-gather is the state dict read at the end) are 3 times the ones its stage's Solution in the
  compiled plan prices for one step (``stage_zero.stage_storage_collectives``, what the stage re-plan
  stores as ``Solution.storage_collectives``), by kind.
One spawn for all cases.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from autoshard.passes.pipeline.stages.stage_zero import stage_storage_collectives
from autoshard.passes.solve.context import PlanContext
from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=2e-5)
CASES = [(None, {"schedule": "1f1b", "microbatches": 2}),
         ("zero1", {"schedule": "1f1b", "microbatches": 2, "accumulation": 2}),
         ("zero2", {"schedule": "zb-h1", "microbatches": 2})]


def _build(name: str):
    from autoshard.testing.models import gpt_pipeline, hf_llama
    torch.manual_seed(0)
    if name == "gpt":
        model, inputs, target, loss_fn, _ = gpt_pipeline(n_layer=4)
        return model, inputs, target, loss_fn
    return hf_llama()


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt``'s state except the 0-d step counters."""
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def zero_pipeline_worker(rank: int, world: int, name: str) -> dict:
    import autoshard
    torch.set_num_threads(1)
    failures, measured = [], {}
    for form, kw in CASES:
        label = f"{name} pp=2 {form or 'replicated'} {kw}"
        model, inputs, target, loss_fn = _build(name)
        params = {"*": (f"R/{form}", "R") if form else ("R", "R")}  # per axis of a stage's (dp, tp) = (2, 1)
        cm = autoshard.compile(model, (4,), pp=2, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", time_limit_s=10, params=params, **kw)
        program = cm._program
        if not cm.plan.pipelined or cm.plan.pp != 2:
            failures.append(f"{label}: premise: no pipeline of 2 rank groups")
            continue
        mine = [s for s in cm.plan.stages if s.index in program.stages]
        forms = {tuple(s.solution.strategies[ph].lowerings or ()) for s in mine for ph in s.solution.strategies
                 if ph in program.stages[s.index].param_names}
        if form and forms != {(form, None)}:
            failures.append(f"{label}: premise: the stages store their parameters as {forms}, not {form}")
        kept = []

        def optimizer(ps, kept=kept):
            opt = adamw(eps=1e-6)(ps)
            kept.append(opt)
            return opt

        failures += train_against_one_device(label, cm, copy.deepcopy(model), (inputs, target), loss_fn=loss_fn,
                                             steps=3, tol=TOL, optimizer=optimizer)
        stage_numel = sum(p.numel() for p in program.local_parameters())
        measured[form or "replicated"] = {"optimizer_bytes": _optimizer_bytes(kept[0]),
                                          "stepped": sum(p.numel() for p in program.parameters()),
                                          "local": stage_numel}
        called = program.zero_calls()
        # the plan arrived as JSON, which keeps no storage collectives: the stage pricing prices them again
        steps = cm.plan.accumulation * cm.plan.microbatches
        priced = Counter(c.kind for s in mine for c in stage_storage_collectives(
            s.solution, program.graphs[s.index].captured, PlanContext.of("cpu", optimizer="adamw"), steps))
        if called != {kind: 3 * n for kind, n in priced.items()}:
            failures.append(f"{label}: rank {rank} called {called} in 3 steps, its stages priced {dict(priced)} "
                            "per step")
        if form and not priced:
            failures.append(f"{label}: premise: the plan prices no ZeRO collective")
    return {"failures": failures, "measured": measured}


def _check(name: str):
    results = run_ranks(zero_pipeline_worker, 4, name, timeout=900)
    failures = failures_of([r["failures"] for r in results])
    assert not failures, "\n".join(failures)
    for rank, r in enumerate(results):
        m = r["measured"]
        full = m["replicated"]
        assert full["stepped"] == full["local"], (rank, full)
        for form in ("zero1", "zero2"):
            z = m[form]
            # measured: AdamW's moments of this rank's slices, half the replicated run's (dp = 2)
            assert z["optimizer_bytes"] * 2 == full["optimizer_bytes"], (rank, form, z, full)
            assert z["stepped"] * 2 == z["local"], (rank, form, z)


def test_zero1_zero2_under_a_pipeline_gpt_match_one_device():
    _check("gpt")


@pytest.mark.slow
def test_zero1_zero2_under_a_pipeline_hf_llama_match_one_device():
    _check("llama")
