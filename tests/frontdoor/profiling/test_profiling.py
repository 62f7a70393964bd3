"""``autoshard profile --quick`` end to end on 2 CPU ranks, and the collective timing's process groups.
The profile format and its fits are tested in tests/passes/cost/test_profile_format.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.cost.profile_format import load_profile
from autoshard.testing.models import MLP
from autoshard.testing.ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(autoshard.__file__)))


@pytest.mark.slow  # a real measurement run
def test_autoshard_profile_quick_end_to_end_on_two_ranks(tmp_path):
    out = tmp_path / "p.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "autoshard.cli", "profile", "--out", str(out), "--quick",
                           "--nproc", "2"], capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out prediction error" in proc.stdout and "median |error|" in proc.stdout
    prof = load_profile(out)
    kinds = {(k, n) for k, n, _, _ in prof.hardware.collective_fits}
    assert kinds == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2), ("all_to_all", 2), ("send_recv", 2)}
    assert prof.data["machine"]["world_size"] == 2 and prof.hardware.flops_fp32 > 1e8
    assert len(prof.held_out_errors()) >= 10
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = autoshard.plan(MLP(16, 64), 2, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware=str(out))
    assert 0 < plan.solution.estimated_step_time < 10


def _coupled_groups_rank(rank: int, world: int):
    import torch.distributed as dist
    from autoshard.profiling.collectives import rank_groups, time_collective
    from autoshard.profiling.timer import Timer
    groups = rank_groups(world, 2, rank)
    members = [dist.get_process_group_ranks(g) for g in groups]
    timer = Timer(torch.device("cpu"), 2, world)
    rows = time_collective(timer, "all_gather", 2, groups, rank, (4096,), torch.device("cpu"), "gloo")
    whole = rank_groups(world, world, rank)
    return members, rows, len(whole)


def test_sub_group_collectives_alternate_over_both_axes_of_a_2d_mesh():
    """Groups of 2 on 4 ranks: the (2, 2) mesh's last-axis pairs {0,1},{2,3} and first-axis pairs
    {0,2},{1,3}; the timed calls alternate between them (one sample per size, per call)."""
    out = run_ranks(_coupled_groups_rank, 4)
    assert [m for m, _, _ in out] == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
    for _, rows, n_world in out:
        assert n_world == 1 and len(rows) == 1 and rows[0][0] == 4096 and rows[0][1] > 0


#: 400 KB: ``calls_per_batch`` gives 10 calls per timed batch (a 4 KiB call gets 50), so the 200 ms of work
#: runs 42 times rather than 202 (8 s of sleeping instead of 40); the call itself still takes milliseconds
AFTER_WORK_BYTES = 400_000


def _after_work_rank(rank: int, world: int):
    import time
    from autoshard.profiling.collectives import rank_groups, time_collective
    from autoshard.profiling.timer import Timer
    ran = [0]

    def work():  # 200 ms of "local work" that leaves the cores free, so its subtraction is exact
        ran[0] += 1
        time.sleep(0.2)
    timer = Timer(torch.device("cpu"), 2, world)
    rows = time_collective(timer, "all_reduce", world, rank_groups(world, world, rank), rank, (AFTER_WORK_BYTES,),
                           torch.device("cpu"), "gloo", local_work=work)
    return rows, ran[0]


def test_a_collective_timed_after_local_work_counts_only_what_the_call_adds():
    """Each timed call follows the local work on every rank; the work's own time is subtracted."""
    for rows, ran in run_ranks(_after_work_rank, 2):
        assert ran > 0 and len(rows) == 1 and rows[0][0] == AFTER_WORK_BYTES
        # a 400 KB all-reduce, not the 200 ms of work before it (the bound leaves room for a loaded machine:
        # one CI run under load 20 timed a 4 KiB call alone at 10.9 ms)
        assert 0 < rows[0][1] < 0.1, rows
