"""All-reduce the gradients of replicated parameters, bucketed and overlapped with backward.

Under the gradient convention a parameter stored ``R`` on a mesh axis holds only a summand of its
gradient there, so after backward its gradient is summed over every such axis. As in DDP, the
parameters are packed into flat buckets in the order their gradients become ready (reverse order
of first use in the forward program); a post-accumulate-grad hook copies each gradient into its
bucket and, once a bucket is full, launches an async all-reduce, so communication overlaps the
rest of backward. Buckets launch strictly in order, so every rank issues the same collectives in
the same order. ``finish`` waits and leaves each gradient as a view into its reduced bucket.

Gradients already present when a step begins (accumulation across steps without ``zero_grad``)
are set aside and added back after the reduction, so they are not summed twice. With gradient
accumulation inside a step, ``set_aside`` runs before the first microstep and ``arm`` before the
last one's backward: the earlier microsteps' gradients accumulate in ``.grad`` unreduced and are
part of the sum the last microstep's hooks copy into the buckets.

``reduce_dtype`` (mixed precision): buckets hold and reduce gradients in that dtype; each gradient
is cast back to its parameter's dtype after the reduction.

``carry``: a bucket reduced over ``carry_comm`` may reserve one extra slot for a scalar (the step's
loss), which then rides along with the gradients instead of costing a collective of its own.
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
    dtype: torch.dtype
    params: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    numel: int = 0
    flat: Optional[torch.Tensor] = None
    pending: int = 0
    work: object = None
    slot: Optional[int] = None  # index of the carried scalar, if this bucket carries one


class GradSync:
    """Bucketed gradient all-reduce for ``params``: a list of (parameter, comm to sum over), in the
    order gradients are expected to become ready. Bucket caps in bytes; the first is small so
    communication starts early."""

    def __init__(self, params: list[tuple[nn.Parameter, AxisComm]], *, bucket_bytes: int = 25 * 2**20,
                 first_bucket_bytes: int = 2**20, carry_comm: Optional[AxisComm] = None,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        self._flat_view: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_view: dict[nn.Parameter, torch.Tensor] = {}
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self._next = 0
        self.active = False
        open_: dict[tuple, _Bucket] = {}
        for p, comm in params:
            if not p.requires_grad or comm.size == 1:
                continue
            dtype = reduce_dtype or p.dtype
            key = (id(comm), dtype, p.device)
            b = open_.get(key)
            cap = first_bucket_bytes if len(self.buckets) == 0 or b is self.buckets[0] else bucket_bytes
            if b is None or (b.numel and (b.numel + p.numel()) * dtype.itemsize > cap):
                b = _Bucket(comm, dtype)
                self.buckets.append(b)
                open_[key] = b
            self._where[p] = (b, len(b.params))
            b.params.append(p)
            b.offsets.append(b.numel)
            b.numel += p.numel()
        self._carrier = next((b for b in self.buckets if b.comm is carry_comm
                              and b.dtype in (torch.float32, torch.float64)), None)
        if self._carrier is not None:
            self._carrier.slot = self._carrier.numel
        for b in self.buckets:
            p0 = b.params[0]
            b.flat = torch.zeros(b.numel + (b.slot is not None), dtype=b.dtype, device=p0.device)
            for p, off in zip(b.params, b.offsets):
                self._flat_view[p] = b.flat[off:off + p.numel()]
                self._grad_view[p] = self._flat_view[p].view_as(p)
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._ready)

    def flat_buffers(self) -> list[torch.Tensor]:
        """The buckets' flat tensors: allocated once, here, and alive as long as this object (after a
        step each synced gradient is a view into one), forward included."""
        return [b.flat for b in self.buckets]

    @property
    def num_params(self) -> int:
        return len(self._where)

    @property
    def carries(self) -> bool:
        """Whether ``carry`` is available (some bucket is reduced over ``carry_comm``)."""
        return self._carrier is not None

    def carry(self, value: torch.Tensor) -> None:
        """Put a scalar in the carrying bucket; after ``finish``, ``carried()`` is its sum."""
        self._carrier.flat[self._carrier.slot].copy_(value.detach().reshape(()))

    def carried(self) -> torch.Tensor:
        return self._carrier.flat[self._carrier.slot].clone()

    def begin(self) -> None:
        """Call before backward: set aside gradients already present, arm the hooks."""
        self.set_aside()
        self.arm()

    def set_aside(self) -> None:
        """Set aside the gradients already present (they are added back after the reduction)."""
        self.active = False
        self._stash.clear()
        for p in self._where:
            if p.grad is not None:
                self._stash[p] = p.grad.clone()
                p.grad = None

    def arm(self) -> None:
        """Call before the backward whose gradients are final: each one is then bucketed as it lands."""
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self._next = 0
        self.active = True

    def _ready(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        b, _ = self._where[p]
        self._flat_view[p].copy_(p.grad.reshape(-1))
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
                for p in b.params:
                    if p.grad is None:
                        self._flat_view[p].zero_()
                b.pending = 0
        self._launch_ready()
        for b in self.buckets:
            b.work.wait()
            for p in b.params:
                if p.grad is None:
                    continue
                view = self._grad_view[p]
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
                if p in self._stash:
                    p.grad.add_(self._stash[p])
        self._stash.clear()
