"""Spread independent jobs (plans, mostly) over the ranks of a ``run_ranks`` world and give every rank
every job's result.

A multi-case worker (``moe_check``, ``zoo_check``, ``test_equivalence``) used to plan each case on
rank 0 while the other ranks waited in a broadcast: on a 2-core CI machine one core planned and the
other idled, case after case. ``spread_over_ranks`` runs job ``i`` on rank ``i % world`` (all ranks
plan at once) and then shares the results, so the cases' plans cost about ``1 / min(world, cores)``
of the serial time. Every case is still planned exactly once, by the same call with the same
arguments: the planner is deterministic (fixed seed, workers and deterministic time), so which rank
solves a case does not change its plan.

    outcomes = spread_over_ranks([lambda: plan(case) for case in cases])
    for outcome in outcomes:
        plan_json = outcome.value()          # raises the job's error on every rank, as run_and_broadcast does

Results travel as JSON (``runtime.groups.broadcast_json``, one broadcast pair per rank), never pickle.
Alone (no torch.distributed) every job runs here, in order.
"""
from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["Outcome", "spread_over_ranks"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One job's result: ``ok`` and its JSON-able ``result``, or the error it raised (class name,
    message, and the traceback's last lines from the rank that ran it)."""
    ok: bool
    result: Any = None
    error: str = ""
    message: str = ""
    where: str = ""

    def value(self) -> Any:
        """The job's result, or a ``RuntimeError`` naming the job's error (the same on every rank)."""
        if not self.ok:
            raise RuntimeError(f"{self.error}: {self.message} (raised on {self.where})")
        return self.result


def _run(job: Callable[[], Any], rank: int) -> dict:
    try:
        return {"ok": True, "result": job()}
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        last = " / ".join(traceback.format_exc().strip().splitlines()[-3:])
        return {"ok": False, "error": type(e).__name__, "message": str(e), "where": f"rank {rank}: {last}"}


def spread_over_ranks(jobs: Sequence[Callable[[], Any]], *, env: Optional[Any] = None) -> list[Outcome]:
    """Run ``jobs[i]()`` on rank ``i % world`` and return every job's ``Outcome`` on every rank, in
    job order. Every rank must call it with the same number of jobs (each job may close over the
    rank's own objects; only its JSON-able result travels)."""
    import torch.distributed as dist

    from autoshard.runtime.groups import broadcast_json

    if not dist.is_available() or not dist.is_initialized():
        return [Outcome(**_run(job, 0)) for job in jobs]
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {str(i): _run(job, rank) for i, job in enumerate(jobs) if i % world == rank}
    done: dict[str, dict] = {}
    for src in range(min(world, len(jobs))):
        done.update(broadcast_json(mine if src == rank else None, src=src, env=env))
    return [Outcome(**done[str(i)]) for i in range(len(jobs))]
