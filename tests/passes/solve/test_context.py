"""The planning context: one default per setting, shared with the front door, hardware resolved once."""
import dataclasses

import pytest

from autoshard.options import PlanOptions
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.solve.context import PlanContext
from autoshard.driver import planning_context


def test_context_resolves_hardware_and_memory_once():
    ctx = PlanContext.of("h100")
    assert ctx.spec == get_hardware("h100")
    assert ctx.memory_bytes == get_hardware("h100").memory_bytes
    assert PlanContext.of("h100", 1_000_000).memory_bytes == 1_000_000.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.memory_limit = 5


def test_front_door_defaults_are_the_contexts():
    options = PlanOptions()
    ctx = planning_context(options, "cpu")
    bare = PlanContext.of("cpu")
    assert (ctx.optimizer, ctx.time_limit_s, ctx.memory_limit) == (bare.optimizer, bare.time_limit_s, None)
    custom = planning_context(PlanOptions(optimizer="sgd", time_limit_s=7, memory_limit=123), "cpu")
    assert (custom.optimizer, custom.time_limit_s, custom.memory_bytes) == ("sgd", 7, 123.0)
