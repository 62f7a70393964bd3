"""The lever table generates the rest (issue 29 item 3): a lever added as one row of ``LEVERS`` (here a
test-local row) reaches the keywords, the pins, the block policy space, the JSON and the summary
without any of them being edited; each row names the modules that price and run it."""
from __future__ import annotations

import pathlib

import pytest

import autoshard
import autoshard.passes.levers as lever_table
from autoshard.options import PlanOptions
from autoshard.passes.errors import AutoshardError
from autoshard.passes.levers import LEVERS, BlockPolicy, Lever, Levers, block_policies
from autoshard.passes.solve.lever_costs import POLICIES
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.summary import lever_text

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _offload_problem(flag):
    return None if isinstance(flag, bool) else f"offload_activations= takes True/False, got {flag!r}"


#: bytes/s each way over PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b encoding (PCI-SIG base spec 5.0)
HOST_LINK = 32e9 * 16 * 128 / 130 / 8


def _offload_price(on, item, hardware):
    """The activations a block keeps go to the host and come back for the backward."""
    item.seconds += 2 * item.kept / HOST_LINK
    item.kept = 0.0


#: a per-block lever the table does not have: the guide's worked example (docs/extension.md)
OFFLOAD = Lever("offload_activations", "offload_activations", True, "True/False per repeated-block type",
                _offload_problem, False, from_json=bool, choices=(False, True), price=_offload_price,
                effects=("runtime/lower.py",))


@pytest.fixture
def offload_row(monkeypatch):
    monkeypatch.setattr(lever_table, "LEVERS", LEVERS + (OFFLOAD,))


def test_a_lever_added_as_a_row_reaches_the_policy_space_pins_json_and_summary(offload_row):
    space = block_policies()
    assert len(space) == 2 * len(POLICIES)  # every policy, without and with the new lever, fastest first
    assert space[0] == BlockPolicy() and space[1] == BlockPolicy(offload_activations=True)
    # the keyword and its check, from the row
    pins = PlanOptions.of(offload_activations={"blocks.#": True}).lever_pins()
    assert pins.offload_activations == {"blocks.#": True} and LeverPins().offload_activations is None
    with pytest.raises(AutoshardError, match="offload_activations= takes True/False"):
        LeverPins(offload_activations="yes")
    # the pins narrow the generated space; "off" pins it at its default
    allowed = pins.policies(["blocks.#"])["blocks.#"]
    assert allowed and all(space[i].offload_activations for i in allowed)
    assert LeverPins.off().offload_activations is False and LeverPins.off().chooses_nothing
    # the JSON round-trips through the row, and a plan written before the row reads as not pulled
    levers = Levers(2, {"blocks.#": BlockPolicy("full", True, True)})
    data = levers.to_json()
    assert data["blocks"]["blocks.#"]["offload_activations"] is True
    assert Levers.from_json(data) == levers
    assert BlockPolicy.from_json({"checkpoint": "full", "reshard_after_forward": True}).offload_activations is False
    # the summary names it by its label
    assert "offload activations True" in lever_text(levers)


def test_a_lever_priced_beside_its_row_is_planned_with_that_price(offload_row):
    """The planner prices the test-local lever through its row's ``price`` hook: pinned on, a GPT's blocks
    keep no activations on the device (the plan's estimated peak drops) and the step
    pays their moves; the plan's levers and summary carry it."""
    from autoshard.testing import models
    model, inputs, target, loss = models.gpt(d=64, n_layer=2, seq=32)
    kw = dict(example_inputs=inputs, loss_fn=loss, example_target=target, hardware="h100", time_limit_s=10,
              accumulation=1, checkpoint="none", reshard_after_forward=False)
    plain = autoshard.plan(model, (2,), **kw, offload_activations=False)
    off = autoshard.plan(model, (2,), **kw, offload_activations=True)
    assert off.solution.levers.blocks and all(p.offload_activations for p in off.solution.levers.blocks.values())
    assert off.estimated_memory < plain.estimated_memory
    assert off.estimated_step_time > plain.estimated_step_time
    assert "offload activations True" in off.summary()


def test_the_generated_policy_space_is_the_one_the_planner_prices():
    """Without a new row the space is the five policies the cost model prices, in the planner's order
    (torchtitan's op-level "selective_op" last: the planner takes it only where it is pinned), and a pin
    against a forced value says which lever forces it."""
    assert POLICIES == (BlockPolicy("none", False), BlockPolicy("none", True), BlockPolicy("selective", True),
                        BlockPolicy("full", True), BlockPolicy("selective_op", True)) == block_policies()
    assert LeverPins().policies(["b.#"]) == {"b.#": [0, 1, 2, 3]}
    assert LeverPins(checkpoint="selective_op").policies(["b.#"]) == {"b.#": [4]}
    with pytest.raises(AutoshardError, match="checkpoint='full' with reshard_after_forward=False cannot hold"):
        LeverPins(checkpoint={"b.#": "full"}, reshard_after_forward={"b.#": False}).policies(["b.#"])


def test_every_row_names_the_modules_that_give_it_its_effect():
    for row in LEVERS:
        assert row.effects, row.keyword
        for path in row.effects:
            text = (ROOT / path).read_text()
            assert row.keyword in text, f"{row.keyword}: {path} does not mention it"
