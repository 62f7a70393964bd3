"""When planning fails on rank 0, ``autoshard.compile`` raises the same error on every rank, at once.

Only rank 0 plans; the others wait for its plan in a broadcast. If rank 0 raised without telling
them, they would wait until torchrun's timeout (minutes) and die with a bare collective error. Here
a hang is a failure: the ranks get a short timeout, and each case must end well inside it.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.runtime.groups import run_and_broadcast
from autoshard.testing.models import MLP
from autoshard.testing.ranks import run_ranks

WORLD = 4
TIMEOUT_S = 60.0
QUICK_S = 20.0  # one failing compile, planning included, takes a second or two

# compile() keywords that make planning fail on rank 0, and the error class every rank must raise
FAILING = {
    "plain, no plan fits": ({"memory_limit": 1}, "InfeasiblePlanError"),
    "pipeline, no plan fits": ({"memory_limit": 1, "pp": "auto", "time_limit_s": 5.0}, "InfeasiblePlanError"),
    "pin matching nothing": ({"params": {"nothing.*": ("S(0)", "R")}}, "PinError"),
    "unknown pin keyword": ({"parameters": {"fc1.weight": ("S(0)", "R")}}, "TypeError"),
}


def net() -> MLP:
    """16 -> 64 -> 16 with a ReLU."""
    return MLP(16, 64, activation=F.relu)


def failing_compile_worker(rank: int, world: int) -> dict:
    """Every case of FAILING on this rank: the error's class and message, and how long compile took."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    out = {}
    for case, (kwargs, _) in FAILING.items():
        t0 = time.monotonic()
        try:
            autoshard.compile(net(), (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                              hardware="cpu", **kwargs)
            error = None
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            error = (type(e).__name__, str(e))
        out[case] = {"error": error, "seconds": time.monotonic() - t0}
    return out


def test_a_planning_error_on_rank0_reaches_every_rank_without_a_hang():
    start = time.monotonic()
    results = run_ranks(failing_compile_worker, WORLD, init="env", timeout=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S
    for case, (_, expected) in FAILING.items():
        errors = [r[case]["error"] for r in results]
        assert all(e is not None for e in errors), f"{case}: compile succeeded on some rank: {errors}"
        assert [e[0] for e in errors] == [expected] * WORLD, f"{case}: {errors}"
        assert len({e[1] for e in errors}) == 1, f"{case}: every rank reports rank 0's message: {errors}"
        slowest = max(r[case]["seconds"] for r in results)
        assert slowest < QUICK_S, f"{case}: a rank took {slowest:.1f} s to hear of the error"


def test_alone_the_work_runs_here_and_its_error_is_raised_as_is():
    assert run_and_broadcast(lambda: {"plan": [1, 2]}) == {"plan": [1, 2]}
    boom = autoshard.InfeasiblePlanError("nothing fits")

    def fail():
        raise boom

    with pytest.raises(autoshard.InfeasiblePlanError) as info:
        run_and_broadcast(fail)
    assert info.value is boom
