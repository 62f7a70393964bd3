"""The front door's options, lever table and driver, in one process on small models.

- ``PlanOptions`` is built and checked once, before anything is traced, with errors naming the keyword;
- the lever table (``passes.levers.LEVERS``) is what the keywords, the checks and the JSON follow;
- the driver traces each program once: ``plan`` with levers chosen traces the global batch and the
  chosen microstep, never either twice.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autoshard
from autoshard.driver import ModelBatch, choose, to_microbatch, trace
from autoshard.options import PlanOptions
from autoshard.passes.errors import AutoshardError, OptionError
from autoshard.passes.levers import LEVER_KEYWORDS, LEVERS, BlockPolicy, Levers, MixedPrecision, check_lever
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.testing.models import gpt


def test_options_split_keywords_into_levers_and_pins_and_are_frozen():
    opts = PlanOptions.of(hardware="cpu", accumulation=2, checkpoint=None, params={"wte.weight": ("R",)}, ops={})
    assert opts.levers == {"accumulation": 2}  # None: not given
    assert opts.pins == {"params": {"wte.weight": ("R",)}}  # empty: not given
    assert opts.lever_pins() == LeverPins(accumulation=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.hardware = "h100"
    assert opts.with_levers(accumulation=None).levers == {}


@pytest.mark.parametrize("keywords, error, match", [
    ({"accumulation": 0}, OptionError, r"accumulation=0: pass an int >= 1"),
    ({"checkpoint": {"blocks.#": "most"}}, OptionError, r"checkpoint='most': choose one of"),
    ({"reshard_after_forward": "yes"}, OptionError, r"reshard_after_forward= takes True/False"),
    ({"mixed_precision": "bf16"}, OptionError, r"mixed_precision= takes autoshard.MixedPrecision"),
    ({"pp": "yes"}, ValueError, r"pp='yes'"),
    ({"microbatches": 0}, TypeError, r"microbatches=0"),
    ({"time_limit_s": -1}, TypeError, r"time_limit_s=-1"),
    ({"paramz": {}}, TypeError, r"unknown keyword\(s\) \['paramz'\]; pins are"),
])
def test_each_bad_keyword_is_refused_by_name_before_anything_is_traced(keywords, error, match):
    with pytest.raises(error, match=match):
        PlanOptions.of(**keywords)


def test_a_lever_error_is_both_a_type_error_and_an_autoshard_error():
    with pytest.raises(TypeError):
        check_lever("accumulation", 1.5)
    with pytest.raises(AutoshardError):
        LeverPins(reshard_after_forward={"blocks.#": 1})
    with pytest.raises(AutoshardError, match="choose one of"):
        BlockPolicy("most")


def test_the_lever_table_is_what_pins_levers_and_json_follow():
    assert all(getattr(LeverPins(), k) is None for k in LEVER_KEYWORDS)
    step = {row.json_key for row in LEVERS if not row.per_block}
    per_block = {row.json_key for row in LEVERS if row.per_block}
    assert per_block == set(BlockPolicy().to_json())
    levers = Levers(2, {"blocks.#": BlockPolicy("full", True)}, MixedPrecision(torch.bfloat16, torch.float32))
    data = levers.to_json()
    assert set(data) == step | {"blocks"} and set(data["blocks"]["blocks.#"]) == per_block
    assert Levers.from_json(data) == levers
    # the defaults in the table are the values of levers not pulled
    assert Levers.from_json({}) == Levers() and BlockPolicy.from_json({}) == BlockPolicy()
    assert all(row.problem(row.default) is None for row in LEVERS if row.default is not None)


def test_combinations_an_entry_cannot_honour_are_refused_with_the_entry_named():
    with pytest.raises(TypeError, match="pass pp='auto'"):
        PlanOptions.of(schedule="1f1b").check_entry("plan")
    for lever in (dict(checkpoint="full"), dict(reshard_after_forward=False), dict(accumulation=2)):
        PlanOptions.of(pp=2, **lever).check_entry("plan")  # every memory lever goes with a pipeline
        PlanOptions.of(pp=2, **lever).check_entry("compile")
    with pytest.raises(TypeError, match=r"params \(pins\) cannot be combined with plan\(\.\.\., pp=2\)"):
        PlanOptions.of(pp=2, params={"w": ("R",)}).check_entry("plan")
    PlanOptions.of(pp=2, params={"w": ("R",)}).check_entry("compile")  # compile re-solves stages with them
    with pytest.raises(TypeError, match=r"ops \(pins\) cannot be combined with pp=2"):
        PlanOptions.of(pp=2, ops={"linear": ("R",)}).check_entry("compile")


def test_the_driver_traces_each_program_once(monkeypatch):
    import autoshard.driver as driver
    calls = []
    real = driver.capture

    def counting(model, inputs, **kw):
        calls.append(tuple(inputs[0].shape))
        return real(model, inputs, **kw)

    monkeypatch.setattr(driver, "capture", counting)
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt()
    batch = ModelBatch(model, inputs, loss_fn, target)
    chosen = choose(batch, Mesh((2,)), PlanOptions.of(hardware="cpu", accumulation=2))
    assert calls == [(4, 16)]  # pinned: only the microstep is traced
    runtime = to_microbatch(autoshard.Plan.from_json(chosen.plan.to_json()), batch, Mesh((2,)))
    assert calls == [(4, 16)] and runtime.captured is trace(batch, 2)  # what choose traced, bound again
    assert runtime.solution.levers.accumulation == 2


def test_plan_captured_refuses_a_microstep_count_it_would_have_to_trace():
    from autoshard.api import plan_captured
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import PlanFormatError
    model, inputs, target, loss_fn = gpt()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    batch = ModelBatch.of_captured(captured)
    with pytest.raises(PlanFormatError, match="plan the model with autoshard.plan"):
        trace(batch, 2)
    plan = plan_captured(captured, (2,), hardware="cpu")
    assert plan.captured is captured and plan.solution.levers.accumulation == 1
