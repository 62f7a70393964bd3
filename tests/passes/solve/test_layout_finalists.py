"""The plan without a pipeline is never worse than a published layout of its mesh's shape under the
overlapped step it reports (issue 28 item 4; ``passes/solve/layout_finalists.py``).

The case: a meta GPT (``testing.models.GPT``: width 1024, 2 blocks, batch 16 x 512) on 8 H100s. The lever search's
additive optimum keeps some parameters as ZeRO forms whose post-step all-gathers are exposed, while
torchtitan's FSDP without reshard-after-forward hides its gathers and reductions behind compute: it
is additively slower and faster with overlap. Without the layouts among the finalists (the planner
before this change, reproduced by giving it no hints) the plan loses to that layout under its own
figure; with them it does not.
"""
from __future__ import annotations

import pytest
import torch

import autoshard
import autoshard.driver as driver
from autoshard import layouts
from autoshard.passes.solve.finalists import overlapped_step, pick_finalist
from autoshard.testing.models import GPT, lm_loss


@pytest.fixture(scope="module")
def case():
    with torch.device("meta"):
        model = GPT(vocab=4096, d=1024, n_layer=2, n_head=8, seq=512, tied=False)
    ids = torch.empty(16, 512, dtype=torch.long, device="meta")
    return model, dict(example_inputs=(ids,), loss_fn=lm_loss, example_target=ids, hardware="h100")


@pytest.fixture(scope="module")
def fsdp_keep(case):
    model, common = case
    return autoshard.plan(model, 8, layout=layouts.fsdp(reshard_after_forward=False), **common)


def test_the_plan_is_never_worse_than_the_layout_under_the_overlapped_step(case, fsdp_keep):
    model, common = case
    ours = autoshard.plan(model, 8, **common)
    assert overlapped_step(ours.solution) <= overlapped_step(fsdp_keep.solution) * (1 + 1e-9), \
        (overlapped_step(ours.solution), overlapped_step(fsdp_keep.solution))
    record = ours.solution.solver_stats["finalists"]
    assert record["layouts"] >= 1 and record["layout_chosen"] and record["changed"]
    assert record["chosen_overlapped_s"] < record["additive_choice_overlapped_s"]


def test_without_the_layouts_among_the_finalists_the_plan_loses_to_it(case, fsdp_keep, monkeypatch):
    """The case is one the planner got wrong: its additive optimum is not the overlap optimum."""
    model, common = case
    monkeypatch.setattr(driver, "mesh_layout_hints", lambda captured, mesh: [])
    old = autoshard.plan(model, 8, **common)
    assert "layouts" not in old.solution.solver_stats["finalists"]
    assert overlapped_step(old.solution) > overlapped_step(fsdp_keep.solution) * 1.001
    assert old.estimated_step_time < fsdp_keep.estimated_step_time  # the additive sum ranks them the other way


class _S:
    def __init__(self, additive: float, overlapped: float):
        self.estimated_step_time, self.estimated = additive, {"overlapped_step_s": overlapped}


def test_a_layout_wins_only_when_strictly_faster_under_overlap():
    searched, tie, faster = _S(1.0, 0.9), _S(1.1, 0.9), _S(1.2, 0.8)
    chosen, record = pick_finalist([searched, tie], lambda s: s, additive_index=0)
    assert chosen is searched and not record["changed"] and record["layouts"] == 1 and not record["layout_chosen"]
    chosen, record = pick_finalist([searched, tie, faster], lambda s: s, additive_index=0)
    assert chosen is faster and record["layout_chosen"] and record["layouts"] == 2


def test_a_layout_pinned_at_one_microstep_reads_zero1_as_zero2_in_any_pin_form():
    """A layout's pins may hold texts, Placements or tuples of both (an expert-parallel layout's do):
    at one microstep only the texts' ``/zero1`` become ``/zero2``, every other pin kept as given."""
    from autoshard.passes.solve.layout_finalists import _at_microsteps
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.spec import Replicate, Shard

    pins = Pins(params={"w": ("R/zero1", "S(0)"), "e": (Shard(0), Replicate()), "b": "R/zero1", "n": Replicate()},
                inputs={0: ("S(0)", "R")}, strategies={"mm": 3})
    one = _at_microsteps(pins, 1)
    assert one.params == {"w": ("R/zero2", "S(0)"), "e": (Shard(0), Replicate()), "b": "R/zero2", "n": Replicate()}
    assert one.inputs == pins.inputs and one.strategies == pins.strategies
    assert _at_microsteps(pins, 2) is pins
