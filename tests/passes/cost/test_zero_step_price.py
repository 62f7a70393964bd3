"""A parameter stored ZeRO-1/ZeRO-2 pays its optimizer step on the slice it owns, as a plain
parameter pays its whole update: before, ZeRO forms were charged no optimizer step at all, which made
them look cheaper than they are next to replicated and sharded parameters."""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import R, S, Strategy, TensorMeta


class _Facts:
    """The few facts a parameter's price reads: its output meta, dtype kept, the model's bytes."""

    def __init__(self, meta: TensorMeta):
        self.meta = meta
        self.kind = {"p_w": "param"}
        self.training = True
        self.param_bytes = meta.nbytes

    def tensor_outputs(self, name):
        return [self.meta]

    def master_dtype(self, name):
        return None

    def overhead(self, name):
        return 0.0


@pytest.mark.parametrize("form", ["zero1", "zero2"])
def test_a_zero_parameter_pays_the_optimizer_step_of_its_slice(form):
    mesh = Mesh((4,))
    cm = CostModel(mesh, get_hardware("h100"))
    meta = TensorMeta((4096, 4096), torch.float32)
    facts = _Facts(meta)
    zero = cm.price_node("p_w", Strategy((), ((R,),), (form,)), facts)
    slice_step = cm.param_step_seconds(meta, (S(0),))
    assert slice_step > 0
    assert zero.compute == pytest.approx(slice_step)
    plain = cm.price_node("p_w", Strategy((), ((R,),)), facts)
    assert plain.compute == pytest.approx(4 * slice_step)  # the replicated copy updates all of it
    off = CostModel(mesh, get_hardware("h100"), price_step=False)  # a caller adding it elsewhere
    assert off.price_node("p_w", Strategy((), ((R,),), (form,)), facts).compute == 0.0


@pytest.mark.parametrize("form, whole", [("zero1", True), ("zero2", False)])
def test_under_accumulation_a_zero_gradient_accumulates_as_it_is_held(form, whole):
    """Each microstep after the first adds its gradient into the stored one: a ``zero1`` gradient is held
    whole between microsteps (reduce-scattered once per step), a ``zero2`` one as its slice. The ILP
    priced both into the slice, while the stage profiles (``stage_zero.zero_step_costs``) priced ``zero1``
    whole: one cost model now."""
    from autoshard.passes.solve.microbatch import MicrobatchCostModel
    mesh, m = Mesh((4,)), 8
    cm = MicrobatchCostModel(mesh, get_hardware("h100"), "adamw", m)
    meta = TensorMeta((4096, 4096), torch.float32)
    price = cm.price_node("p_w", Strategy((), ((R,),), (form,)), _Facts(meta))
    held = (R,) if whole else (S(0),)
    want = cm.optimizer_step_seconds(meta, (S(0),)) / m + cm.accumulate_seconds(meta, held) * (m - 1) / m
    assert price.compute == pytest.approx(want, rel=1e-12)
    assert cm.accumulate_seconds(meta, (R,)) == pytest.approx(4 * cm.accumulate_seconds(meta, (S(0),)))
