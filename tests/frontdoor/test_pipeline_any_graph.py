"""Pipelines over a program with no numbered blocks: the 1-D U-Net of named modules
(``testing.models.UNet1d``, a long skip from ``d1`` to ``u1``, GroupNorm) is cut by the stage planner on
its op graph and trains through pp=2 and pp=4 under every schedule on (4,) (and pp=2 on (2, 2)),
microbatches of one sample,
equal to one device (loss at every step, parameters after 2 AdamW steps); so does a 2-block GPT cut
into 8 stages (pp=4 DualPipeV), more stages than it has blocks, on its op graph. One spawn of 4 gloo
ranks runs every case. Asking for more stages than the graph can be cut into is a ``StageCutError`` naming
the cut, not a memory error."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.models import gpt, unet1d
from autoshard.testing.ranks import run_ranks
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
MICROBATCHES = 8  # the global batch: one sample per microbatch (dualpipev with pp=4 needs 2 * pp)
TOL = Tolerance(rtol=1e-4, atol=2e-5)


def _build():
    torch.manual_seed(0)
    return unet1d()


def _model(name: str):
    """(model, inputs, target, loss_fn) of the U-Net, or of the 2-block GPT (fewer blocks than stages)."""
    if name == "unet1d":
        return _build()[:4]
    torch.manual_seed(0)
    return gpt()


def any_graph_worker(rank: int, world: int, cases: list) -> list:
    import autoshard

    torch.set_num_threads(1)
    failures = []
    for name, mesh, pp, schedule in cases:
        label = f"{name} on {mesh} pp={pp} {schedule}"
        model, inputs, target, loss_fn = _model(name)
        try:
            cm = autoshard.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                   hardware="cpu", pp=pp, schedule=schedule, microbatches=MICROBATCHES,
                                   time_limit_s=20)
        except autoshard.AutoshardError as e:
            failures.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if not cm.plan.pipelined or (cm.plan.pp, cm.plan.schedule) != (pp, schedule):
            failures.append(f"{label}: got {type(cm).__name__} {getattr(cm, 'plan', None)}")
            continue
        failures += train_against_one_device(label, cm, copy.deepcopy(model), (inputs, target), loss_fn=loss_fn,
                                             steps=2, tol=TOL, optimizer=adamw(lr=1e-3))
    return failures


def test_named_unet_trains_through_every_schedule_at_pp_2_and_4():
    cases = [("unet1d", (4,), pp, s) for pp in (2, 4) for s in SCHEDULES] + [("unet1d", (2, 2), 2, "1f1b"),
                                                                            ("gpt", (4,), 4, "dualpipev")]
    failures = failures_of(run_ranks(any_graph_worker, 4, cases, timeout=900))
    assert not failures, "\n".join(failures)


def test_planner_cuts_the_named_unet_on_its_op_graph():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.layer_costs import layer_units
    from autoshard.passes.pipeline.stages.op_cuts import cut_points
    from autoshard.passes.pipeline.stages.planner import plan_pipeline

    model, inputs, target, loss_fn, _ = _build()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    units = layer_units(captured)
    assert len(units) >= 8 and all(u.block is None for u in units)
    points = {c.node: c for c in cut_points(captured)}
    # the skip from d1 is live across every boundary inside the U; before d1's output exists it is not
    skip = captured.node("silu").meta["autoshard.meta"].nbytes
    assert points["conv1d_3"].live_bytes == points["cat"].live_bytes  # u and a, then cat alone ...
    assert points["conv1d_1"].live_bytes == skip  # a alone crosses after d1
    assert points["conv1d_2"].live_bytes > skip  # a (the skip) and b cross inside the U
    assert points["getitem"].refused is not None
    plan = plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=20),
                         PipelinePins(pp=4, schedule="1f1b", microbatches=8))
    assert plan.pp == 4 and len(plan.stages) == 4
    assert [n for s in plan.stages for n in s.nodes] == [n.name for n in captured.gm.graph.nodes
                                                        if n.op == "call_function"]


class TwoLinear(nn.Module):
    """Named (unnumbered) layers; ops: linear, linear_1 and the loss's three."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x))


def test_too_many_stages_is_a_cut_error_not_a_memory_error():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import InfeasiblePlanError, StageCutError
    from autoshard.passes.pipeline.stages.planner import plan_pipeline

    torch.manual_seed(0)
    captured = capture(TwoLinear(), (torch.randn(8, 8),), loss_fn=F.mse_loss, target=torch.randn(8, 8))
    for kw, stages, says in ((dict(pp=4, schedule="dualpipev"), 8, "4 units"),
                             (dict(pp=4, schedule="1f1b"), 4, "only 2 of the units read a parameter")):
        with pytest.raises(StageCutError, match=f"no valid stage cut into {stages} stages") as err:
            plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=10), PipelinePins(**kw))
        assert not isinstance(err.value, InfeasiblePlanError) and "memory" not in str(err.value)
        assert "refused: before getitem" in str(err.value) and says in str(err.value)
    for schedule in ("1f1b", "dualpipev"):  # what the graph can give is planned
        plan = plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=10),
                             PipelinePins(pp=2, schedule=schedule))
        assert plan.pp == 2 and len(plan.stages) == 2 * (schedule == "dualpipev") + 2


def test_too_few_microbatches_for_the_schedule_is_a_schedule_error():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import InfeasiblePlanError
    from autoshard.passes.pipeline.schedule.simulate import ScheduleError
    from autoshard.passes.pipeline.stages.planner import plan_pipeline

    model, inputs, target, loss_fn, _ = _build()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    for schedule, m, rule in (("dualpipev", 4, "m=4 < 2\\*p=8; use m >= 8"),):
        with pytest.raises(ScheduleError, match=rule) as err:
            plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=10),
                          PipelinePins(pp=4, schedule=schedule, microbatches=m))
        assert not isinstance(err.value, InfeasiblePlanError)


def test_more_stages_than_blocks_cut_inside_the_blocks():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.layer_costs import layer_units
    from autoshard.passes.pipeline.stages.planner import plan_pipeline

    model, inputs, target, loss_fn = _model("gpt")
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    assert [u.name for u in layer_units(captured)] == ["embedding", "blocks.0", "blocks.1", "head"]
    plan = plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=20),
                         PipelinePins(pp=4, schedule="dualpipev", microbatches=8))
    assert len(plan.stages) == 8
    plan = plan_pipeline(captured, (4,), PlanContext.of("cpu", time_limit_s=20),
                         PipelinePins(pp=2, schedule="1f1b", microbatches=8))
    starts = {u.nodes[0] for u in layer_units(captured)}
    assert plan.stages[1].nodes[0] in starts  # enough blocks: the cut stays between them
