"""``autoshard.compile`` end to end, as torchrun starts it, and the errors users meet first.

Ranks start with only RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torchrun's environment), so
compile() itself joins the process group, rank 0 solves, and the plan reaches the others as JSON.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import MLP
from autoshard.testing.ranks import run_ranks


def net() -> MLP:
    """16 -> 64 -> 16 with a ReLU."""
    return MLP(16, 64, activation=F.relu)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def compile_worker(rank: int, world: int, from_meta: bool) -> dict:
    torch.manual_seed(0)
    reference = net()
    torch.manual_seed(0)
    if from_meta:
        with torch.device("meta"):
            model = net()
    else:
        model = net()
    x, y = _data()
    cm = autoshard.compile(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(cm.step(x, target=y))
        opt.step(); opt.zero_grad()
        loss = F.mse_loss(reference(x), y)
        ref_losses.append(loss.item())
        loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    full = cm.full_state_dict()
    forward = cm(x, target=y)
    return {"losses": losses, "ref_losses": ref_losses, "full": full, "ref": reference.state_dict(),
            "plan": cm.plan.to_json(), "forward": forward, "ref_forward": F.mse_loss(reference(x), y).detach().reshape(())}


@pytest.mark.parametrize("from_meta", [False, True], ids=["cpu-model", "meta-model"])
def test_compile_under_torchrun_env_matches_one_device(from_meta):
    results = run_ranks(compile_worker, 4, from_meta, init="env")
    plans = [r["plan"] for r in results]
    assert all(p == plans[0] for p in plans), "every rank must run the plan rank 0 solved"
    for r in results:
        assert r["losses"] == results[0]["losses"], "the reported loss is identical on every rank"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4)
        for k, v in r["ref"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r["forward"], r["ref_forward"], rtol=1e-4, atol=1e-6)


def mismatch_worker(rank: int, world: int):
    x, y = _data()
    autoshard.compile(net(), (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)


def test_mesh_that_differs_from_world_size_shows_the_arithmetic():
    with pytest.raises(autoshard.MeshError, match=r"2\*2 = 4.*3"):
        run_ranks(mismatch_worker, 3, init="env", timeout=60)


def test_untraceable_model_names_the_construct_and_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if self.fc(x).sum() > 0:  # data-dependent control flow
                return x
            return -x

    with pytest.raises(autoshard.TraceError) as info:
        autoshard.plan(Branchy(), 2, example_inputs=(torch.randn(4, 4),))
    message = str(info.value)
    assert "test_compile.py" in message and "data-dependent" in message.lower()


def test_no_plan_fits_memory_shows_the_smallest_need():
    x, y = _data()
    with pytest.raises(autoshard.InfeasiblePlanError) as info:
        autoshard.plan(net(), 4, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="cpu",
                       memory_limit=100)
    message = str(info.value)
    assert "100" in message and "smallest" in message.lower()
    assert any(word in message for word in ("params", "optimizer", "activations", "grads"))


def test_batch_that_does_not_divide_is_reported():
    x, y = torch.randn(6, 16), torch.randn(6, 16)
    with pytest.raises(autoshard.AutoshardError, match=r"6.*4|4.*6"):
        autoshard.plan(net(), 4, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="cpu",
                       inputs={0: ("S(0)",)})


def wrong_batch_worker(rank: int, world: int):
    x, y = _data()
    cm = autoshard.compile(net(), (world,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                           **autoshard.presets.data_parallel((world,)))
    cm.step(torch.randn(5, 16), target=torch.randn(5, 16))


def test_step_with_a_batch_of_another_shape_is_reported():
    with pytest.raises(autoshard.BatchError, match=r"\(5, 16\).*\(8, 16\)"):
        run_ranks(wrong_batch_worker, 2, init="env", timeout=60)
