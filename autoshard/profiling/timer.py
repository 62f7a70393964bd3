"""Timing every rank together: the slowest rank's median seconds per call.

A step waits for its slowest rank, so ``Timer`` times a batch of calls on every rank at once, takes
each rank's median over ``repeats`` batches and reports the maximum over ranks. Every rank must
call it together (it synchronizes with barriers and an all-reduce when the world has more than one
rank). ``calls_per_batch`` picks how many calls a batch holds, the same on every rank.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Timer", "calls_per_batch"]


class Timer:
    """Times ``fn`` on ``device`` over ``repeats`` batches, in a world of ``world`` ranks."""

    def __init__(self, device: torch.device, repeats: int, world: int):
        self.device, self.repeats, self.world = device, repeats, world

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], None], iters: int, fence: bool = False) -> float:
        """Slowest rank's median seconds per call of ``fn`` (every rank must call this together).

        ``fence``: the batch ends at a barrier, so its time runs until the LAST rank is done: local
        work timed while every rank competes for the cores, as in a step (without it a rank that
        finishes early sleeps in the next barrier and lends its core to the others)."""
        fn()
        self._sync()
        times = []
        for _ in range(self.repeats):
            if self.world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            self._sync()
            if fence and self.world > 1:
                dist.barrier()
            times.append((time.perf_counter() - t0) / iters)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64,
                           device=self.device if self.device.type == "cuda" else "cpu")
        if self.world > 1:
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return float(med.item())


def calls_per_batch(work: float, budget: float = 4e6, most: int = 50) -> int:
    """Calls per timed batch: more for small work (same on every rank: collectives need it)."""
    return int(max(2, min(most, budget / max(work, 1.0))))
