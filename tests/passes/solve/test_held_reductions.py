"""FSDP gradients reduced once per step (storage form ``once``, ``passes.solve.held_reductions``):
the planner holds the gathered copies' gradients over the microsteps where memory allows, which
saves the per-microstep reduce-scatters, and not where the held bytes do not fit. One process, a
meta GPT on mesh (4,), every parameter pinned FSDP ``S(0)``, accumulation 2."""
import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.sharding.storage_forms import holds_copies
from autoshard.passes.solve.held_reductions import hold_reductions
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.solution import evaluate
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.solve.context import PlanContext

MESH = Mesh.of((4,))


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(256, 128, 2, 4, 64, False)
    ids = torch.empty(8, 64, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids)


def _plan(gpt, storage_forms: bool, limit=None):
    return plan_sharding(gpt, MESH, PlanContext.of("h100", memory_limit=limit), pins=Pins(params={"*": ("S(0)",)}),
                         levers=LeverPins(accumulation=2, checkpoint="none", reshard_after_forward=False),
                         traced_at_microbatch=True, storage_forms=storage_forms)


def _price(gpt, plain):
    return lambda strategies: evaluate(gpt, MESH, strategies, PlanContext.of("h100", optimizer="adamw"),
                                       levers=plain.levers, traced_at_microbatch=True)


def test_held_where_memory_allows_saving_reduce_scatters(gpt):
    """On the FSDP plan (planned without storage forms) with room: some copies' gradients are held,
    the step is faster, the peak higher by what is held; nothing is held without room or when every
    parameter's form is pinned (a bare pin is the plain form: the planner keeps it, as
    ``plan_sharding`` does with the user's pins)."""
    plain = _plan(gpt, storage_forms=False)
    assert not any(holds_copies(plain.strategies[ph]) for ph in gpt.params)
    held = hold_reductions(plain, gpt, set(), 1e15, _price(gpt, plain))
    once = [ph for ph in gpt.params if holds_copies(held.strategies[ph])]
    assert once and held.solver_stats["held_reductions"] == len(once)
    assert held.estimated_step_time < plain.estimated_step_time
    assert held.estimated_memory > plain.estimated_memory  # the held gradients' bytes


def test_nothing_is_held_without_room(gpt):
    plain = _plan(gpt, storage_forms=False)
    room = max(plain.estimated.get("peak_forward_bytes", plain.estimated_memory),
               plain.estimated.get("peak_backward_bytes", plain.estimated_memory))
    assert hold_reductions(plain, gpt, set(), room, _price(gpt, plain)) is plain
    assert hold_reductions(plain, gpt, set(gpt.params), 1e15, _price(gpt, plain)) is plain  # all pinned
    roomy = hold_reductions(plain, gpt, set(), 1e15, _price(gpt, plain))
    assert roomy is not plain and any(holds_copies(roomy.strategies[ph]) for ph in gpt.params)
