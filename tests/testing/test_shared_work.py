"""autoshard/testing/shared_work.py: the multi-case workers' jobs (plans) run once each, spread over the
ranks, and every rank gets every result in job order, a failed job's error included."""
from __future__ import annotations

import os

import pytest

from autoshard.testing.ranks import run_ranks
from autoshard.testing.shared_work import spread_over_ranks


def _jobs(log_dir: str, rank: int, n: int):
    def job(i):
        def run():
            with open(os.path.join(log_dir, f"job{i}"), "a") as f:
                f.write(f"{rank}\n")  # who ran it, once per run
            if i == 3:
                raise ValueError("job 3 cannot be planned")
            return {"job": i, "square": i * i}
        return run
    return [job(i) for i in range(n)]


def _spread_worker(rank: int, world: int, log_dir: str, n: int) -> list:
    return [(o.ok, o.result, o.error, o.message) for o in spread_over_ranks(_jobs(log_dir, rank, n))]


def test_each_job_runs_once_on_its_rank_and_every_rank_gets_every_result(tmp_path):
    n = 5  # more jobs than ranks: rank 0 runs jobs 0, 2 and 4
    per_rank = run_ranks(_spread_worker, 2, str(tmp_path), n, timeout=120)
    assert per_rank[0] == per_rank[1]
    for i, (ok, result, error, message) in enumerate(per_rank[0]):
        assert (tmp_path / f"job{i}").read_text() == f"{i % 2}\n"  # once, on rank i % world
        if i == 3:
            assert not ok and error == "ValueError" and "cannot be planned" in message
        else:
            assert ok and result == {"job": i, "square": i * i}


def test_alone_every_job_runs_here_in_order_and_a_failure_raises_on_value(tmp_path):
    outcomes = spread_over_ranks(_jobs(str(tmp_path), 0, 4))
    assert [o.value() for o in outcomes[:3]] == [{"job": i, "square": i * i} for i in range(3)]
    with pytest.raises(RuntimeError, match="ValueError: job 3 cannot be planned"):
        outcomes[3].value()
