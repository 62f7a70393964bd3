"""A user's params pins under a pipeline hold on the stage submesh the search chooses.

``compile(pp=2, params=...)`` pins every parameter per axis of a stage's (dp, tp) submesh. The pipeline
search plans only the submeshes where each pin holds as written (``pinned_shapes.usable_stage_shapes``):
on a (1, 2) submesh ``R/zero2`` on the size-1 dp axis would silently store parameters replicated, and a
bias pinned ``(S(0), R)`` could not be placed at all. Checked on ``driver.choose(for_runtime=True)``, the
choice ``compile`` makes on rank 0, in one process.
"""
from __future__ import annotations

import pytest
import torch

from autoshard.driver import ModelBatch, choose, trace
from autoshard.options import PlanOptions
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.pipeline.stages.pinned_shapes import usable_stage_shapes, why_pins_miss_submesh
from autoshard.passes.sharding.pins import PinError
from autoshard.passes.spec import Replicate, Shard
from autoshard.testing.models import gpt_pipeline

CPU = PlanContext.of("cpu").spec


def _batch():
    torch.manual_seed(0)
    model, inputs, target, loss_fn, _ = gpt_pipeline(n_layer=4)
    return ModelBatch(model, inputs, loss_fn, target)


@pytest.mark.parametrize("params, schedule, form", [
    ({"*": ("R/zero2", "R")}, "zb-h1", ("zero2", None)),
    ({"*": ("S(0)", "R")}, "1f1b", (None, None)),
])
def test_compile_choice_keeps_every_stage_on_a_submesh_its_pins_hold(params, schedule, form):
    chosen = choose(_batch(), Mesh((4,)), PlanOptions.of(hardware="cpu", time_limit_s=10, pp=2, schedule=schedule,
                                                         microbatches=2, params=params), for_runtime=True)
    plan = chosen.plan
    assert plan.pipelined and plan.pp == 2
    params_of = plan.captured.params  # placeholder node -> FQN
    for stage in plan.stages:
        assert tuple(stage.mesh.shape) == (2, 1), f"stage {stage.index} on {stage.mesh.shape}"
        stored = [(s.outputs[0], tuple(s.lowerings or ()) or (None, None))
                  for node, s in stage.solution.strategies.items() if node in params_of]
        assert stored, f"premise: stage {stage.index} stores parameters"
        assert {forms for _, forms in stored} == {form}, stored
        first = {str(pls[0]) for pls, _ in stored}
        assert first == ({str(Shard(0))} if params["*"][0] == "S(0)" else {str(Replicate())}), first


def test_why_pins_miss_submesh_names_each_cause():
    captured = trace(_batch(), 1)
    assert why_pins_miss_submesh(captured, {"*": ("R/zero2", "R")}, Mesh((2, 1))) is None
    assert "size 1" in why_pins_miss_submesh(captured, {"*": ("R/zero2", "R")}, Mesh((1, 2)))
    assert "size 1" in why_pins_miss_submesh(captured, {"*bias": ("S(0)", "R")}, Mesh((1, 2)))
    assert "does not divide" in why_pins_miss_submesh(captured, {"blocks.0.ln1.weight": ("R", "S(0)")},
                                                      Mesh((1, 3)))
    assert "one placement per axis" in why_pins_miss_submesh(captured, {"*": ("R/zero2",)}, Mesh((2, 1)))


def test_pins_no_stage_submesh_holds_are_refused_before_solving():
    captured = trace(_batch(), 1)
    with pytest.raises(PinError, match=r"fit no stage submesh.*\(dp, tp\) = \(2, 1\).*one placement per axis"):
        usable_stage_shapes(captured, Mesh((4,)), CPU, {"*": ("R/zero2",)}, [2])
    assert usable_stage_shapes(captured, Mesh((4,)), CPU, None, [2]) is None
    assert usable_stage_shapes(captured, Mesh((4,)), CPU, {"*": ("R/zero2", "R")}, [2, 4]) == [(2, 1)]
