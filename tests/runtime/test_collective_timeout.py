"""Ranks waiting in different collectives end in an error within the timeout, never a hang (issue 31,
item 2): ``runtime.collective_watch`` arms every process group's timeout when a rank's program is built
(``AUTOSHARD_COLLECTIVE_TIMEOUT_S``) and turns the backend's failure into ``CollectiveError`` naming
the rank, the stage, the action and the op.

Without it gloo waits 30 minutes: both tests here would run into ``run_ranks``' own timeout.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.errors import CollectiveError
from autoshard.runtime.collective_watch import TIMEOUT_ENV, arm_timeout, step_timeout_s, watching
from autoshard.runtime.collectives import AxisComm, all_gather, all_to_all
from autoshard.testing.ranks import run_ranks

TIMEOUT_S = 4


def _outcome(run) -> tuple:
    """(exception class name or None, message, seconds) of ``run()``; the process group is torn down
    after a failure (its pairs are broken: the harness's closing barrier would only wait again)."""
    start = time.monotonic()
    try:
        run()
        return None, "", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        outcome = type(e).__name__, str(e), time.monotonic() - start
    dist.destroy_process_group()
    return outcome


def _two_collectives_worker(rank: int, world: int) -> tuple:
    arm_timeout(TIMEOUT_S)
    comm = AxisComm("tp", world, rank, dist.group.WORLD)
    x = torch.ones(4, 4)

    def run():
        with watching(rank=rank, stage=1, action="F0"):
            all_gather(x, 0, comm) if rank == 0 else all_to_all(x, 0, 1, comm)
    return _outcome(run)


def test_ranks_in_different_collectives_raise_collective_error_within_the_timeout():
    """The ModernBERT symptom: one rank of a stage in all_gather, the other in all_to_all."""
    results = run_ranks(_two_collectives_worker, 2, timeout=60)
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind == "CollectiveError", (rank, kind, message)
        assert f"rank {rank}, stage 1, action F0" in message
        assert ("all_gather over 'tp'" if rank == 0 else "all_to_all over 'tp'") in message
        assert seconds < 3 * TIMEOUT_S, (rank, seconds)


def _mismatched_step_worker(rank: int, world: int) -> tuple:
    torch.set_num_threads(1)
    os.environ[TIMEOUT_ENV] = str(TIMEOUT_S)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    cm = autoshard.compile(model, (world,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                           hardware="cpu", time_limit_s=5, pp=2, microbatches=2, schedule="1f1b")
    assert step_timeout_s() == TIMEOUT_S
    if rank == world - 1:  # this rank runs another program: its all-reduces are all-gathers
        def all_gather_instead(tensor, op=None, group=None, async_op=False):
            out = tensor.new_empty((dist.get_world_size(group) * tensor.numel(),))
            return dist.all_gather_into_tensor(out, tensor.reshape(-1), group=group, async_op=async_op)
        dist.all_reduce = all_gather_instead
    return _outcome(lambda: cm.step(x, target=y))


def test_a_rank_running_a_mismatched_collective_ends_the_pipelined_step_in_an_error():
    results = run_ranks(_mismatched_step_worker, 4, timeout=240)
    kinds = [kind for kind, _, _ in results]
    assert all(kind is not None for kind in kinds), results
    assert "CollectiveError" in kinds, results
    for rank, (kind, message, seconds) in enumerate(results):
        assert seconds < 4 * TIMEOUT_S + 10, (rank, seconds, message)
        if kind == "CollectiveError":
            assert message.startswith(f"rank {rank}"), message
            assert "all_reduce" in message or "recv" in message or "send" in message, message


def test_a_bad_timeout_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        step_timeout_s()
    monkeypatch.delenv(TIMEOUT_ENV)
    assert step_timeout_s() > 0
