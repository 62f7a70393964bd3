"""The partition drawing names the stage planner's cut on a program without numbered blocks: every
stage after the first says which op (and module) it starts at and what it receives from where; the
U-Net's long skip is drawn straight from stage 0 to the stage that reads it."""
from __future__ import annotations

import re

import torch
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext


def test_drawing_names_the_planners_stage_boundaries():
    from autoshard.drawing import plan_to_dot
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.planner import plan_pipeline
    from autoshard.testing.models import unet1d

    torch.manual_seed(0)
    model, inputs, target, loss_fn, _ = unet1d()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    plan = plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=20),
                         PipelinePins(pp=4, schedule="1f1b", microbatches=8))
    dot = plan_to_dot(plan)
    labels = dict(re.findall(r'subgraph cluster_stage_(\d+) \{ label="([^"]*)"', dot))
    assert sorted(map(int, labels)) == [0, 1, 2, 3]
    assert "cut before" not in labels["0"]
    for stage in plan.stages[1:]:
        first = captured.node(stage.nodes[0])
        module = first.meta.get("autoshard.module") or "-"
        assert f"cut before {first.name} (module {module})" in labels[str(stage.index)], labels[str(stage.index)]
    # d1's activated output ("silu") is the long skip into cat; it goes straight to cat's stage
    reader = next(s.index for s in plan.stages if "cat" in s.nodes)
    assert next(s.index for s in plan.stages if "silu" in s.nodes) == 0
    assert reader >= 2, f"premise: the planner puts the U's bottom between d1 and u1 ({[s.nodes for s in plan.stages]})"
    assert "silu from stage 0" in labels[str(reader)]
    hops = set(re.findall(r'"silu" -> "cat" \[[^\]]*label="p2p (\d)->(\d)"', dot))
    assert hops == {("0", str(reader))}
