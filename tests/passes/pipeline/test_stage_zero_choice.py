"""The stage planner chooses ZeRO-1 / ZeRO-2 on its own (issue 28 item 1): each pipeline candidate's intra-op
solve (``candidate_plan.plan_submesh``) offers the parameters' storage forms, priced per microbatch (a ``zero2``
reduce-scatter every microbatch) and per step (a ``zero1`` reduce-scatter, the parameter all-gather after the
optimizer step: ``layer_costs._zero_step_costs``).

A 4-block GPT (d 512, 13.6 M parameters, AdamW in fp32: 16 B per parameter) pipelined over 2 rank groups of 4
under 150 MB per device: replicated weights need ~110 MB of state per stage and leave too little for the
activations of the microbatches in flight, so without ZeRO forms the planner pays for it in tensor parallel
or FSDP gathers (4.64 ms). Sharding the optimizer state over the data axis (``R/zero1``) fits at 3.46 ms.
"""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.retrace import replan_at_microbatch
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.pipeline.stages.stage_zero import planned_zero_pins
from autoshard.passes.sharding.storage_forms import ZERO1, ZERO2
from autoshard.passes.solve.context import PlanContext
from autoshard.testing.models import GPT, lm_loss

LIMIT = 150e6


def _gpt(batch: int):
    with torch.device("meta"):
        model = GPT(1024, 512, 4, 8, 256, False)
    ids = torch.empty(batch, 256, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


@pytest.fixture(scope="module")
def planned():
    captured = _gpt(32)
    ctx = PlanContext.of("h100", LIMIT, "adamw", 10.0)
    return captured, ctx, plan_pipeline(captured, (2, 4), ctx, PipelinePins(pp=2, schedule="1f1b"))


def _zero_params(plan, captured) -> dict[str, tuple]:
    return {n: tuple(s.lowerings) for st in plan.stages for n, s in st.solution.strategies.items()
            if n in captured.params and any(f in (ZERO1, ZERO2) for f in s.lowerings)}


def test_the_stage_planner_shards_the_optimizer_state_itself_under_memory_pressure(planned):
    captured, _, plan = planned
    assert plan.pp == 2
    chosen = _zero_params(plan, captured)
    assert any(ZERO1 in forms for forms in chosen.values()), "no parameter stored as R/zero1"
    assert all(s.solution.estimated_memory <= LIMIT for s in plan.stages)
    # the step is priced with the forms' collectives: a ZeRO stage's step costs more than its compute alone
    assert plan.simulated_step_time > 0


def test_the_stage_re_solved_at_the_microbatch_keeps_the_planned_zero_forms(planned):
    captured, ctx, plan = planned
    small = _gpt(32 // plan.microbatches)
    pins = {fqn for s in plan.stages for fqn in planned_zero_pins(s.solution, captured)}
    assert pins
    runtime = replan_at_microbatch(plan, captured, small, ctx)
    kept = {small.params[n]: tuple(s.lowerings) for st in runtime.stages for n, s in st.solution.strategies.items()
            if n in small.params and any(f in (ZERO1, ZERO2) for f in s.lowerings)}
    planned_forms = {captured.params[n]: f for n, f in _zero_params(plan, captured).items()}
    assert set(planned_forms) == pins
    # the planned ones keep their form (the re-solve may store more parameters in a ZeRO form)
    assert {fqn: kept.get(fqn) for fqn in pins} == planned_forms
