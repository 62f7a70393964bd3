"""One plan type on disk: plans with and without a pipeline write one format (version 2), and the
files of version 1, which had a kind for each, load as the same plans.

A version-1 plan without a pipeline did not record its op list: it loads as a plan of one stage whose
ops are filled in when it is attached to its program. A version-1 pipelined plan kept its stages under
"pipeline": they load as the plan's stages, its simulated step time as the plan's. Anything else is a
``PlanFormatError`` that says to plan again.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

import autoshard
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.pipeline.plan_file import PLAN_VERSION, upgraded
from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
from autoshard.passes.solve.planner import plan_sharding
from autoshard.testing.models import gpt_pipeline, mlp
from autoshard.passes.solve.context import PlanContext


def _one_stage():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = mlp()
    plan = autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu", time_limit_s=10)
    return plan, capture(model, inputs, loss_fn=loss_fn, target=target)


def test_plans_with_and_without_a_pipeline_write_one_format(tmp_path):
    plan, _ = _one_stage()
    data = plan.to_json()
    assert data["format"] == "autoshard.plan" and data["version"] == PLAN_VERSION == 2
    assert len(data["stages"]) == 1 and data["stages"][0]["ranks"] == [0, 1, 2, 3]
    path = tmp_path / "p.json"
    plan.save(str(path))
    loaded = autoshard.load_plan(str(path))
    assert not loaded.pipelined and loaded.to_json() == data
    assert loaded.estimated_step_time == plan.estimated_step_time and loaded.estimated_memory == plan.estimated_memory


def test_a_version_1_plan_without_a_pipeline_loads_as_one_stage(tmp_path):
    plan, captured = _one_stage()
    v1 = {"format": "autoshard.plan", "version": 1, "mesh": plan.mesh.to_json(), "hardware": plan.hardware,
          "fingerprint": plan.fingerprint, "work": plan.work.to_json(), "solution": plan.solution.to_json()}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(v1))
    loaded = autoshard.load_plan(str(path))
    assert not loaded.pipelined and loaded.stages[0].nodes == []
    assert loaded.solution.to_json() == plan.solution.to_json()
    assert loaded.estimated_step_time == plan.estimated_step_time and loaded.mfu == pytest.approx(plan.mfu)
    bound = loaded.attach(captured)
    assert bound.stages[0].nodes == plan.stages[0].nodes
    # The solver's wall and solve seconds are not saved, so the summaries are compared without them.
    assert bound.estimated_memory == plan.estimated_memory
    without_seconds = lambda text: re.sub(r"(wall_s|solve_s) [0-9.e-]+, ", "", text)
    assert without_seconds(bound.summary()) == without_seconds(plan.summary())


def test_a_version_1_pipelined_plan_loads_with_its_stages(tmp_path):
    torch.manual_seed(0)
    model, inputs, target, loss_fn, prefixes = gpt_pipeline(n_layer=2)
    captured = capture(model, tuple(x[:4] for x in inputs), loss_fn=loss_fn, target=target[:4])
    plan = make_pipeline_plan(captured, stage_nodes_from_prefixes(captured, prefixes[2]), (2,), schedule="1f1b",
                              microbatches=2, solve=lambda g, sm: plan_sharding(g.captured, sm,
                                                                                PlanContext.of("cpu", time_limit_s=10)))
    v1 = {"format": "autoshard.pipelined_plan", "version": 1, "mesh": plan.mesh.to_json(), "hardware": "cpu",
          "fingerprint": plan.fingerprint, "work": None, "batch_coupled": [],
          "pipeline": {"pp": 2, "virtual": 1, "stages": [s.to_json() for s in plan.stages], "schedule": "1f1b",
                       "microbatches": 2, "estimated_step_time": 0.25, "bubble_fraction": 0.2,
                       "peak_activation_memory": [1.0, 2.0]}}
    path = tmp_path / "v1pp.json"
    path.write_text(json.dumps(v1))
    loaded = autoshard.load_plan(str(path))
    assert loaded.pipelined and (loaded.pp, loaded.virtual, loaded.schedule, loaded.microbatches) == (2, 1, "1f1b", 2)
    assert [s.to_json() for s in loaded.stages] == [s.to_json() for s in plan.stages]
    assert loaded.estimated_step_time == 0.25 and loaded.bubble_fraction == 0.2
    assert loaded.attach(captured).estimated_memory == plan.estimated_memory


def test_other_files_say_to_plan_again():
    for bad in ({"format": "autoshard.plan", "version": 3}, {"format": "autoshard.pipelined_plan", "version": 2},
                {"format": "autoshard.plan", "version": 1, "mesh": {"shape": [2]}}):
        with pytest.raises(PlanFormatError, match="plan again"):
            upgraded(bad)
    with pytest.raises(PlanFormatError, match="not an autoshard plan"):
        upgraded({"format": "something"})
