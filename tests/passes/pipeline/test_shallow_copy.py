"""The stage planner prices a deep model through its shallow copy (``passes/pipeline/stages/shallow.py``).

One process, meta-device models. The copy must be the deep program minus its cut blocks, every deep
node must get the decision of its stand-in, the decisions written back must be a consistent plan of
the deep program (the same redistributions a fresh pricing of its strategies finds), and the planner
must answer for a 20-block model exactly as it answers when it prices all 20 blocks.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.layer_costs import layer_units
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.shallow import shallow_program
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.solution import evaluate
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext

LAYERS = 20
D = 768  # two blocks hold a gradient bucket of parameters (shallow.MIN_PARAM_BYTES)


def _capture(model, batch=16, seq=32, vocab=256):
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


@pytest.fixture(scope="module")
def deep():
    with torch.device("meta"):
        model = GPT(256, D, LAYERS, 4, 32, True)
    return _capture(model)


def test_the_copy_keeps_two_blocks_and_maps_every_node(deep):
    shallow = shallow_program(deep)
    assert shallow is not None and shallow.blocks == LAYERS
    assert [u.name for u in shallow.units] == ["embedding", "blocks.0", "blocks.1", "head"]
    deep_units = layer_units(deep)
    kept = {n for u in deep_units if u.name not in {f"blocks.{k}" for k in range(2, LAYERS)} for n in u.nodes}
    shallow_ops = [n.name for n in shallow.captured.gm.graph.nodes if n.op == "call_function"]
    assert shallow_ops == [n.name for n in deep.gm.graph.nodes if n.op == "call_function" and n.name in kept]
    # cut blocks' parameters are gone; the head (and the tied embedding) kept
    assert sorted(shallow.captured.params.values()) == sorted(
        v for v in deep.params.values() if not any(v.startswith(f"blocks.{k}.") for k in range(2, LAYERS)))
    # every op of block k >= 2 stands on its twin in block 1, position by position
    for k in (2, 7, LAYERS - 1):
        for mine, twin in zip(deep_units[1 + k].nodes, deep_units[2].nodes):
            assert shallow.counterpart[mine] == twin
    assert shallow.fqn_counterpart["blocks.13.fc.weight"] == "blocks.1.fc.weight"
    # the head now reads block 1 where it read the last block
    head_first = deep_units[-1].nodes[0]
    reads = {a.name for a in shallow.captured.node(head_first).all_input_nodes}
    assert reads & set(deep_units[2].nodes) and not reads & set(deep_units[LAYERS].nodes)


def test_decisions_written_back_are_a_consistent_deep_plan(deep):
    shallow = shallow_program(deep)
    mesh = Mesh((2, 2))
    # tensor-parallel MLPs, so the plan moves data inside and between blocks
    sol = plan_sharding(shallow.captured, mesh, PlanContext.of("h100", time_limit_s=20),
                        pins={"params": {"blocks.*.fc.weight": ("R", "S(0)"), "blocks.*.out.weight": ("R", "S(1)")}})
    full = shallow.deep_solution(sol)
    ours = {(r.producer, r.consumer, r.operand_index, tuple(map(str, r.src)), tuple(map(str, r.dst)))
            for r in full.redistributions}
    fresh = evaluate(deep, mesh, full.strategies, PlanContext.of("h100"))
    theirs = {(r.producer, r.consumer, r.operand_index, tuple(map(str, r.src)), tuple(map(str, r.dst)))
              for r in fresh.redistributions}
    assert ours == theirs and ours  # the plan moves data somewhere, and exactly where pricing it again says
    assert set(full.param_placements) == set(fresh.param_placements)
    for name, pls in fresh.param_placements.items():
        assert tuple(map(str, full.param_placements[name])) == tuple(map(str, pls))
    assert set(full.param_grad_syncs) == set(fresh.param_grad_syncs)


@pytest.mark.slow  # plans the full-depth model too
def test_folded_planner_answers_as_the_full_depth_one(deep):
    hw = PRESETS["h100"]
    mesh = Mesh((8, 8))
    folded = plan_pipeline(deep, mesh, PlanContext.of(hw, time_limit_s=30), PipelinePins(pp=4))
    full = plan_pipeline(deep, mesh, PlanContext.of(hw, time_limit_s=30), PipelinePins(pp=4), fold_blocks=False)
    assert folded.stages[0].solution.solver_stats["pipeline_search"]["shallow_copy"]["blocks"] == LAYERS
    assert "shallow_copy" not in full.stages[0].solution.solver_stats["pipeline_search"]
    key = (folded.pp, folded.schedule, folded.microbatches, [len(s.nodes) for s in folded.stages],
           [tuple(s.mesh.shape) for s in folded.stages])
    assert key == (full.pp, full.schedule, full.microbatches, [len(s.nodes) for s in full.stages],
                   [tuple(s.mesh.shape) for s in full.stages])
    assert folded.estimated_step_time == pytest.approx(full.estimated_step_time, rel=1e-9)
    # the stages hold the deep program's own nodes, every one of them once
    ops = [n.name for n in deep.gm.graph.nodes if n.op == "call_function"]
    assert [n for s in folded.stages for n in s.nodes] == ops
    for s_f, s_d in zip(folded.stages, full.stages):
        assert {k: str(v) for k, v in s_f.solution.strategies.items()} == \
               {k: str(v) for k, v in s_d.solution.strategies.items()}


class _Skip(nn.Module):
    """Blocks that also read the block two back: not a chain of identical blocks."""

    def __init__(self, d: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        prev, h = x, x
        for block in self.blocks:
            prev, h = h, torch.relu(block(h)) + prev
        return h


def test_programs_that_do_not_qualify_are_planned_as_they_are(deep):
    with torch.device("meta"):
        short = _capture(GPT(256, D, 6, 4, 32, True))
        narrow = _capture(GPT(256, 64, LAYERS, 2, 32, True))
        skip = _Skip(16, 20)
    assert shallow_program(short) is None  # too few blocks to gain anything
    assert shallow_program(narrow) is None  # too small to matter (and the bucket share would be mispriced)
    assert shallow_program(deep, min_blocks=LAYERS + 1) is None
    x = torch.empty(8, 16, device="meta")
    skipping = capture(skip, (x,), loss_fn=lambda out, t: (out - t).pow(2).mean(), target=x.clone())
    assert shallow_program(skipping) is None
