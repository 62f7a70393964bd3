"""The planner never changes what a step computes: a model with batch-coupled ops (BatchNorm in
training mode) gets no gradient accumulation from the solver or from random plans, even when memory
is tight (other levers, or ``InfeasiblePlanError`` saying why accumulation stayed off); an explicit
``accumulation=k`` works and warns, naming the ops. The same model in eval mode (no coupling) is the
control: there random plans do draw accumulation (and the planner uses it at these memory limits),
so these tests can fail.
Meta-device models, one process."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.errors import BatchCouplingWarning, InfeasiblePlanError
from autoshard.testing.models import BlockCNN


def _cnn(train: bool = True):
    with torch.device("meta"):
        model = BlockCNN(channels=32)
    model.train(train)
    x = torch.empty(64, 3, 8, 8, device="meta")
    y = torch.empty(64, dtype=torch.long, device="meta")
    return model, x, y


def _plan(model, x, y, **kwargs):
    return autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y,
                          hardware="h100", **kwargs)


def test_ample_memory_pulls_no_lever_and_notes_the_coupled_ops():
    model, x, y = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchCouplingWarning)
        plan = _plan(model, x, y)
    assert not plan.solution.levers.any_pulled
    assert "blocks.0.bn" in plan.solution.solver_stats["batch_coupled"]
    assert "batch_coupled" in plan.summary() and "gap" in plan.summary()


@pytest.mark.parametrize("limit", [1_000_000, 500_000])
def test_tight_memory_never_turns_to_accumulation(limit):
    # (the same model in eval mode plans with accumulation 8 at 1 MB and 64 at 500 kB; that search
    # takes minutes on a loaded machine, so the control lives in the random-plan test below)
    model, x, y = _cnn()
    try:
        plan = _plan(model, x, y, memory_limit=limit)
    except InfeasiblePlanError as e:
        assert "accumulation was left off" in str(e) and "blocks.0.bn" in str(e)
    else:
        assert plan.solution.levers.accumulation == 1 and plan.estimated_memory <= limit
        assert plan.solution.levers.any_pulled  # it fits with the other levers


def test_random_plans_never_draw_accumulation():
    from autoshard.passes.capture.export import capture
    from autoshard.passes.solve.lever_pins import LeverPins
    from autoshard.passes.solve.random_plans import random_solution

    def drawn(train):
        model, x, y = _cnn(train)
        captured = capture(model, (x,), loss_fn=F.cross_entropy, target=y)
        return {random_solution(captured, (2, 2), seed=s, levers=LeverPins()).levers.accumulation for s in range(12)}

    assert drawn(True) == {1}
    assert max(drawn(False)) > 1  # the control: without coupling, random plans do accumulate


def test_explicit_accumulation_works_and_warns_naming_the_ops():
    model, x, y = _cnn()
    with pytest.warns(BatchCouplingWarning, match=r"accumulation=2 changes what the step computes.*blocks\.0\.bn"):
        plan = _plan(model, x, y, accumulation=2)
    assert plan.solution.levers.accumulation == 2
