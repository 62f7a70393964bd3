"""Shared fixtures of the solver tests: a tiny GPT captured on meta with a memory limit that binds."""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve import planner
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.lever_search import LeverSearch
from autoshard.testing.models import GPT, lm_loss

H100 = get_hardware("h100")


def _plan_within(captured, limit):
    ctx = PlanContext.of(H100, limit, "adamw", 30.0)
    return planner._plan_within(LeverSearch(captured, Mesh.of((2, 2)), ctx, None, LeverPins(), False), ctx)


@pytest.fixture(scope="session")
def plan_within():
    """``plan_within(captured, limit)``: the planner's lever search on (2, 2) H100 under ``limit`` bytes."""
    return _plan_within


@pytest.fixture(scope="session")
def tiny_gpt():
    """(captured tiny GPT, a limit of 0.55 x its unconstrained plan's estimated memory)."""
    with torch.device("meta"):
        model = GPT(256, 64, 2, 4, 64, False)
    ids = torch.empty(8, 64, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    free = _plan_within(captured, H100.memory_bytes)
    return captured, 0.55 * free.estimated_memory
