"""Every special lowering is one ``Lowering`` descriptor in ``passes/cost/lowerings.py`` and one emitter
in the runtime under the same name, and a lowering's costs reach the plan through the descriptor."""
from __future__ import annotations

import pytest

from autoshard.passes.cost.lowerings import LOWERINGS, Lowering, named_lowerings
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.spec import Replicate, Strategy
from autoshard.runtime.lowerings import EMITTERS, register_emitter


def test_every_registered_lowering_has_a_runtime_emitter_and_back():
    without_emitter, without_descriptor = set(LOWERINGS) - set(EMITTERS), set(EMITTERS) - set(LOWERINGS)
    assert not without_emitter and not without_descriptor, (without_emitter, without_descriptor)
    for name, low in LOWERINGS.items():
        assert isinstance(low, Lowering) and low.name == name and low.doc.strip(), name


def test_the_runtime_cannot_register_an_emitter_without_a_descriptor():
    with pytest.raises(KeyError, match="no Lowering named 'fancy_attention'.*register its descriptor"):
        register_emitter("fancy_attention", lambda *a: None)
    with pytest.raises(KeyError, match="already has an emitter"):
        register_emitter("ring_attention", lambda *a: None)


def test_a_strategy_naming_an_unknown_lowering_is_a_clear_error():
    r = (Replicate(),)
    assert [low.name for low in named_lowerings(Strategy((r,), (r,), ("ring_attention", None, "ring_attention")))] == [
        "ring_attention"]
    with pytest.raises(PlanFormatError, match="'fancy_attention', which is not registered"):
        named_lowerings(Strategy((r,), (r,), ("fancy_attention",)))


def test_the_lowerings_with_a_cost_carry_their_hooks():
    """The costs that were special cases in the cost model live on the descriptors."""
    assert LOWERINGS["ring_attention"].price is not None and LOWERINGS["ring_attention"].internal_bytes is not None
    for name in ("expert_dispatch", "expert_dispatch_capacity"):
        assert LOWERINGS[name].collectives is not None and LOWERINGS[name].saved_bytes is not None
