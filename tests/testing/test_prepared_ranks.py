"""``run_ranks(..., prepare=)``: work every rank would repeat (capturing the same model) runs once, in the
process the ranks fork from, and every rank gets its result; a failure there, or a rank that dies, is
reported as before."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from autoshard.testing.ranks import run_ranks


def _prepare(log: str, value: float) -> dict:
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return {"pid": os.getpid(), "tensor": torch.full((3,), value)}


def _rank(rank: int, world: int, prepared: dict, extra: float) -> tuple:
    import torch.distributed as dist
    summed = prepared["tensor"] + extra
    dist.all_reduce(summed)  # the ranks form a process group as without ``prepare``
    return prepared["pid"], os.getppid(), os.getpid(), summed


def _failing_prepare() -> None:
    raise ValueError("the models could not be built")


def _dying_rank(rank: int, world: int, prepared: dict) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_prepare_runs_once_and_every_rank_forks_from_it_with_its_result(tmp_path):
    log = tmp_path / "prepared.txt"
    results = run_ranks(_rank, 3, 1.0, prepare=functools.partial(_prepare, str(log), 2.0), timeout=120)
    runs = log.read_text().split()
    assert len(runs) == 1  # once, not once per rank
    assert {pid for pid, _, _, _ in results} == {int(runs[0])}
    assert all(parent == int(runs[0]) for _, parent, _, _ in results)  # forked from the process that prepared
    assert len({own for _, _, own, _ in results}) == 3
    for *_, summed in results:
        assert torch.equal(summed, torch.full((3,), 9.0))  # 3 ranks x (2 + 1)


def test_a_failure_in_prepare_raises_it():
    with pytest.raises(ValueError, match="could not be built") as info:
        run_ranks(_rank, 2, 0.0, prepare=_failing_prepare, timeout=120)
    assert "raised in prepare" in "".join(getattr(info.value, "__notes__", []))


def test_a_prepared_rank_that_dies_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 3"):
        run_ranks(_dying_rank, 2, init=None, timeout=120,
                  prepare=functools.partial(_prepare, str(tmp_path / "log.txt"), 0.0))
