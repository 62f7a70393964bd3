"""Stage-cut candidates on the op graph of a program with no numbered blocks (``op_cuts``): live bytes
at each boundary, refused boundaries, and, when there are more valid boundaries than units allowed,
units cut where the live set is locally smallest with balanced compute. One process, meta device."""
from __future__ import annotations

import dataclasses
import string

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.pipeline.stages.layer_costs import layer_units
from autoshard.passes.pipeline.stages.op_cuts import MAX_UNITS, cut_points, op_graph_units
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext

D, BATCH = 64, 8


class NamedResidual(nn.Module):
    """``x = x + fc(gelu(x))`` for 26 named (unnumbered) layers ``fc_a`` .. ``fc_z``."""

    def __init__(self):
        super().__init__()
        self.names = [f"fc_{c}" for c in string.ascii_lowercase]
        for name in self.names:
            setattr(self, name, nn.Linear(D, D))

    def forward(self, x):
        for name in self.names:
            x = x + getattr(self, name)(F.gelu(x))
        return x


def _captured():
    with torch.device("meta"):
        model = NamedResidual()
    x = torch.empty(BATCH, D, device="meta")
    return capture(model, (x,), loss_fn=F.mse_loss, target=torch.empty(BATCH, D, device="meta"))


def test_live_bytes_and_refusals():
    captured = _captured()
    points = cut_points(captured)
    ops = [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert [c.node for c in points] == ops[1:]
    one = BATCH * D * 4
    by = {c.node: c for c in points}
    # after a residual add only x is live; between gelu and the linear, x and gelu(x) are
    assert by["gelu_1"].live_bytes == one and by["linear_1"].live_bytes == 2 * one
    assert all(c.refused for c in points if c.node.startswith("getitem")) and not by["gelu_1"].refused


def test_many_boundaries_become_balanced_units_at_local_minima():
    captured = _captured()
    points = {c.node: c for c in cut_points(captured)}
    assert sum(c.refused is None for c in points.values()) + 1 > MAX_UNITS  # premise: more than the budget
    units = layer_units(captured)
    assert len(units) == MAX_UNITS and all(u.block is None for u in units)
    flat = [n for u in units for n in u.nodes]
    assert flat == [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]
    one = BATCH * D * 4
    starts = [u.nodes[0] for u in units[1:]]
    assert all(points[s].live_bytes == one for s in starts), [(s, points[s].live_bytes) for s in starts]
    layers = [sum(n.startswith("linear") for n in u.nodes) for u in units[:-1]]
    assert max(layers) <= 2 and min(layers) >= 1, layers  # 26 layers over 23 units and the loss's
    four = op_graph_units(captured, max_units=4)
    assert all(points[nodes[0]].live_bytes == one for _, nodes in four[1:])
    per = [sum(n.startswith("linear") for n in nodes) for _, nodes in four]
    assert sum(per) == 26 and max(per) - min(per) <= 1, per  # even compute: 26 layers in 4 units


def test_every_rank_group_gets_a_parameter():
    """The stage ILP and its heuristics give no rank group a cut without parameters (its optimizer
    would get an empty list): the balanced cut of these units puts the parameterless last unit alone
    on group 1, which constraint (6) forbids."""
    from autoshard.passes.pipeline.stages.stage_cuts import balanced_stages, even_stages
    from autoshard.passes.pipeline.stages.stage_ilp import solve_stages
    from autoshard.passes.pipeline.stages.stage_problem import StageProblem, every_group_holds_params

    fwd = [1.0, 1.0, 4.0, 4.0]
    free = StageProblem(fwd=fwd, bwd=[2 * f for f in fwd], grad_sync=[0.0] * 4, state=[1.0, 1.0, 1.0, 0.0],
                        act=[1.0] * 4, cut_seconds=[0.0] * 3, cut_bytes=[0.0] * 3, stage_group=[0, 1], held=[2, 1],
                        m=4, memory_limit=1e9)
    held = dataclasses.replace(free, holds_params=[True, True, True, False])
    best = solve_stages(free, time_limit_s=10)
    assert best.starts == [0, 3] and not every_group_holds_params(held, best.starts)  # premise
    got = solve_stages(held, time_limit_s=10)
    assert got is not None and got.starts == [0, 2] and got.step_time > best.step_time
    assert balanced_stages(free) is not None and balanced_stages(held) is None
    assert even_stages(held, False) is not None and every_group_holds_params(held, even_stages(held, False).starts)
    none = dataclasses.replace(free, holds_params=[False, False, False, True])
    assert solve_stages(none, time_limit_s=10) is None  # one unit reads a parameter, two groups want one


def test_a_pinned_boundary_starts_a_unit():
    from autoshard.passes.pipeline.stages.planner import plan_pipeline

    captured = _captured()
    assert all(u.nodes[0] != "linear_5" for u in layer_units(captured))  # premise: not a chosen boundary
    assert any(u.nodes[0] == "linear_5" for u in layer_units(captured, keep=["linear_5"]))
    assert len(layer_units(captured, keep=["linear_5"])) == MAX_UNITS
    plan = plan_pipeline(captured, (2,), PlanContext.of("cpu", time_limit_s=10),
                         PipelinePins(pp=2, schedule="1f1b", stages=["linear_5"]))
    assert plan.stages[1].nodes[0] == "linear_5"
