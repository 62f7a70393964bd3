"""The pipeline partition as graphviz: one cluster per stage (ranks, submesh), p2p edges between them."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from autoshard.passes.solve.context import PlanContext


def _unet_plan():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    from autoshard.testing.models import unet

    torch.manual_seed(0)
    model, inputs, target, loss_fn, prefixes = unet()
    captured = capture(model, tuple(x[:2] for x in inputs), loss_fn=loss_fn, target=target[:2])
    nodes = stage_nodes_from_prefixes(captured, prefixes[4])
    plan = make_pipeline_plan(captured, nodes, (4, 2), schedule="1f1b", microbatches=4,
                              solve=lambda g, sm: plan_sharding(g.captured, sm,
                                                                PlanContext.of("cpu", time_limit_s=10)))
    plan.stages[2].recompute = True
    return plan, captured


def test_stage_clusters_submeshes_and_p2p_edges(tmp_path):
    from autoshard.drawing import plan_to_dot

    plan, captured = _unet_plan()
    dot = plan_to_dot(plan)
    clusters = re.findall(r'subgraph cluster_stage_(\d+) \{ label="([^"]*)"', dot)
    assert [int(i) for i, _ in clusters] == [0, 1, 2, 3]
    for (i, label), stage in zip(clusters, plan.stages):
        assert f"group {stage.group}" in label and f"submesh {tuple(stage.mesh.shape)}" in label
        assert f"ranks {stage.ranks[0]}, {stage.ranks[1]}" in label
        assert ("recompute" in label) == stage.recompute
    # every op is drawn once, inside its stage's cluster
    blocks = re.split(r"subgraph cluster_stage_\d+", dot)[1:]
    for stage, block in zip(plan.stages, blocks):
        body = block.split("\n  }")[0]
        for name in stage.nodes:
            assert f'"{name}" [' in body, f"{name} not drawn in stage {stage.index}"
    # the long skip from stage 0 goes straight to stage 3; neighbours exchange through p2p edges
    hops = set(re.findall(r"p2p (\d)->(\d)", dot))
    assert ("0", "3") in hops and ("0", "1") in hops and ("2", "3") in hops
    assert all(int(a) < int(b) for a, b in hops)
    if shutil.which("dot") is not None:
        from autoshard.drawing import render_dot
        out = render_dot(dot, str(tmp_path / "pipeline.svg"))
        assert "<svg" in open(out).read()


def test_pipelined_model_draws_itself(monkeypatch, tmp_path):
    """A compiled pipeline's render writes the drawing of the plan it runs (here through the .dot
    fallback, without graphviz)."""
    from autoshard.compiled import CompiledModel

    plan, captured = _unet_plan()

    class Program:  # what the compiled model reads here: nothing but its env
        env = None
    cm = CompiledModel(None, plan, program=Program())
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="graphviz"):
        cm.render(str(tmp_path / "p.svg"), detail="ops")
    assert "cluster_stage_3" in (tmp_path / "p.dot").read_text()


def test_measured_timeline_as_a_step_result(tmp_path):
    """Measured events become a SimResult: times from the first start, busy time per rank, bubble."""
    from autoshard.runtime.pipeline.interpreter import TimelineEvent
    from autoshard.runtime.pipeline.timelines import draw_measured_timeline, measured_result

    timelines = {0: [TimelineEvent(0, "0F0", 10.0, 11.0), TimelineEvent(0, "0BW0", 13.0, 15.0)],
                 1: [TimelineEvent(1, "1F0", 11.0, 12.0), TimelineEvent(1, "1B0", 12.0, 12.5),
                     TimelineEvent(1, "1W0", 12.5, 13.0)]}
    result = measured_result(timelines)
    assert result.step_time == 5.0 and result.busy == [3.0, 2.0]
    assert result.bubble_fraction == pytest.approx(1 - 5.0 / 10.0)
    assert [(r, str(a), s, e) for r, a, s, e in result.events][:2] == [(0, "0F0", 0.0, 1.0), (0, "0BW0", 3.0, 5.0)]
    svg = open(draw_measured_timeline(timelines, tmp_path / "t.svg")).read()
    assert svg.count("<rect") >= 6 and ">BW0<" in svg and ">W0<" in svg
    with pytest.raises(ValueError, match="compute action label"):
        measured_result({0: [TimelineEvent(0, "SEND", 0.0, 1.0)]})
