"""Each microbatch's share of a step's mean loss: its count of non-ignored targets over the step's.

A step of k microbatches (accumulation x pipeline microbatches) seeds every microbatch's backward with
``1 / k`` and averages the k losses. That is one device's step only when every microbatch's loss divides
by the same count. A mean class loss divides by the targets that are not ``ignore_index``
(``passes.loss_counts``), and padded batches hold different numbers per microbatch. ``StepWeights``
counts them (``passes.loss_counts``' programs, on the microbatches every rank already holds) and gives
microbatch i the weight ``n_i / N``: the seeds and the averaged loss then equal one device's mean over
the whole batch. Equal counts give ``None`` (the ``1 / k`` path, unchanged to the bit).

With ``local_batch`` each rank holds its data-parallel slice of every microbatch: the counts are
summed over the world (one all-reduce of k numbers) and divided by the ranks that hold each slice.
A program whose loss adds other terms to the class loss (``LossCounts.exact`` False) cannot be weighted
by one number per microbatch: when its counts differ, ``StepWeights`` warns once
(``BatchCouplingWarning``, naming the loss) and keeps ``1 / k``.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from autoshard.passes.errors import BatchCouplingWarning
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.loss_counts import loss_counts

from .collective_watch import watching

__all__ = ["StepWeights"]


class StepWeights:
    """Weights of one step's microbatches for ``captured`` (the program of one microbatch) run on
    ``device``; ``n``: microbatches per step."""

    def __init__(self, captured: CapturedGraph, device, n: int):
        self.n = n
        self.reads_target = captured.target is not None
        self.counts = loss_counts(captured, device=device) if n > 1 else None
        self._warned = False

    def __call__(self, user: list, targets: list, *, replicas: Optional[int] = None) -> Optional[list[float]]:
        """``user``: per input, its microbatches; ``targets``: the target's. ``replicas``: with
        ``local_batch``, the ranks holding each data-parallel slice (counts are then summed over the
        world and divided by it). None when the counts are equal (or there is nothing to count)."""
        if not self.counts:
            return None
        per_loss = []
        with torch.no_grad():
            for program in self.counts.programs:
                per_loss.append([program(*[u[i] for u in user], *([targets[i]] if self.reads_target else []))
                                 for i in range(self.n)])
        counts = torch.stack([torch.stack(c) for c in per_loss]).to(torch.float64)
        if replicas is not None:
            with watching(action="the all-reduce of the microbatches' target counts"):
                dist.all_reduce(counts)
            counts = counts / replicas
        if bool((counts == counts[:, :1]).all()):
            return None
        if not self.counts.exact:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"the step's {self.n} microbatches hold different numbers of targets that count toward the mean "
                    f"loss ({', '.join(self.counts.losses)}), and the loss adds other terms to it: each microbatch's "
                    f"mean is averaged with weight 1/{self.n}, which is not the whole batch's mean (one device); run "
                    "without accumulation and pipeline microbatches, or give the loss a sum reduction divided by a "
                    "count you pass", BatchCouplingWarning, stacklevel=3)
            return None
        row = counts[0]
        total = float(row.sum())
        if total == 0:
            return None  # every target ignored: the loss is NaN on one device too
        return [float(c) / total for c in row]
