"""All-reduce the gradients of replicated parameters, bucketed and overlapped with backward.

Under the gradient convention a parameter stored ``R`` on a mesh axis holds only a summand of its
gradient there, so after backward its gradient is summed over every such axis. As in DDP, the
parameters are packed into flat buckets in the order their gradients become ready (reverse order
of first use in the forward program); a post-accumulate-grad hook copies each gradient into its
bucket and, once a bucket is full, launches an async all-reduce, so communication overlaps the
rest of backward. Buckets launch strictly in order, so every rank issues the same collectives in
the same order. ``finish`` waits and leaves each gradient as a view into its reduced bucket.

Gradients already present when a step begins (accumulation across steps without ``zero_grad``)
are set aside and added back after the reduction, so they are not summed twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import AxisComm

__all__ = ["GradSync"]


@dataclass(eq=False)
class _Bucket:
    comm: AxisComm
    params: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    numel: int = 0
    flat: Optional[torch.Tensor] = None
    pending: int = 0
    work: object = None


class GradSync:
    """Bucketed gradient all-reduce for ``params``: a list of (parameter, comm to sum over), in the
    order gradients are expected to become ready. Bucket caps in bytes; the first is small so
    communication starts early."""

    def __init__(self, params: list[tuple[nn.Parameter, AxisComm]], *, bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = 2**20):
        self.buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self._next = 0
        self.active = False
        open_: dict[tuple, _Bucket] = {}
        for p, comm in params:
            if not p.requires_grad or comm.size == 1:
                continue
            key = (id(comm), p.dtype, p.device)
            b = open_.get(key)
            cap = first_bucket_bytes if len(self.buckets) == 0 or b is self.buckets[0] else bucket_bytes
            if b is None or (b.numel and (b.numel + p.numel()) * p.element_size() > cap):
                b = _Bucket(comm)
                self.buckets.append(b)
                open_[key] = b
            self._where[p] = (b, len(b.params))
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.numel()
        for b in self.buckets:
            p0 = b.params[0]
            b.flat = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._ready)

    @property
    def num_params(self) -> int:
        return len(self._where)

    def begin(self) -> None:
        """Call before backward: arm the hooks, set aside gradients already present."""
        self._stash.clear()
        for p in self._where:
            if p.grad is not None:
                self._stash[p] = p.grad.clone()
                p.grad = None
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self._next = 0
        self.active = True

    def _ready(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        b, i = self._where[p]
        n = p.numel()
        b.flat[b.offsets[i]:b.offsets[i] + n].copy_(p.grad.reshape(-1))
        b.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            b.work = dist.all_reduce(b.flat, group=b.comm.group, async_op=True)
            self._next += 1

    def finish(self) -> None:
        """Call after backward: launch what is left (zeros for gradients that never came), wait,
        and point every gradient at its reduced bucket."""
        self.active = False
        for b in self.buckets[self._next:]:
            if b.pending:
                for p, off in zip(b.params, b.offsets):
                    if p.grad is None:
                        b.flat[off:off + p.numel()].zero_()
                b.pending = 0
        self._launch_ready()
        for b in self.buckets:
            b.work.wait()
            for p, off in zip(b.params, b.offsets):
                if p.grad is None:
                    continue
                p.grad = b.flat[off:off + p.numel()].view_as(p)
                if p in self._stash:
                    p.grad.add_(self._stash[p])
        self._stash.clear()
