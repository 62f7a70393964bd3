"""All-reduce the gradients of replicated parameters, bucketed and overlapped with backward.

Under the gradient convention a parameter stored ``R`` on a mesh axis holds only a summand of its
gradient there, so after backward its gradient is summed over every such axis. As in DDP, the
parameters are packed into flat buckets in the order their gradients become ready (reverse order
of first use in the forward program); a post-accumulate-grad hook copies each gradient into its
bucket and, once a bucket is full, launches an async all-reduce, so communication overlaps the
rest of backward. Buckets launch strictly in order, so every rank issues the same collectives in
the same order. ``finish`` waits and leaves each gradient as a view into its reduced bucket.

One per stage of a rank's program (``runtime.stage``), whatever the schedule: ``arm`` right before
the last action of the step that adds to the stage's weight gradients (the last microbatch's
backward, or its zero-bubble W); the gradients of the earlier microbatches (and rounds of
accumulation) accumulate in ``.grad`` unreduced and are part of the sum the hooks copy into the
buckets then. A zero-bubble W sets gradients without hooks and reports each as it lands
(``mark_ready``). ``launch_rest`` after that action launches what is left (a parameter without a
gradient contributes zeros); ``finish`` waits. ``overlapped``: buckets launched before
``launch_rest`` in the last step (overlapped with the stage's backward). Gradients already present
when a step begins are the program's to set aside (``runtime.executor``).

``reduce_dtype`` (mixed precision): buckets hold and reduce gradients in that dtype; each gradient
is cast back to its parameter's dtype after the reduction.

Gradients in their buckets (``grads_in_buckets``, DDP's ``gradient_as_bucket_view``): ``begin_step``
zeroes every bucket whose dtype is its parameters' and points each parameter's ``.grad`` at its slice
of it before the step's first backward, so autograd accumulates every microbatch's gradient in place
in the bucket and nothing is copied in (``copies`` counts the gradients copied into buckets in the
step: 0 unless someone replaced a ``.grad`` during the step, or a bucket's dtype differs). A
parameter that received no gradient in the step gets ``None`` back, as without the views, so an
optimizer skips it. Gradients present when the step begins are taken off first and returned to the
executor, which adds them back after the reduction: a bucket view left all zeros (``zero_grad(
set_to_none=False)``) is the identity and not copied. Caveats, as DDP's: between steps ``.grad`` is
a view into the bucket, so ``grad.detach_()`` raises and the next step overwrites what a caller kept
of it (clone it to keep it). Off for a stage whose zero-bubble W sets gradients outside the hooks in
rounds before the last (it could not tell which parameters received one).

``carry``: a bucket reduced over ``carry_comm`` may reserve one extra slot for a scalar (the step's
loss), which then rides along with the gradients instead of costing a collective of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .collective_watch import note
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
                 reduce_dtype: Optional[torch.dtype] = None, grads_in_buckets: bool = True):
        self.buckets: list[_Bucket] = []
        self.grads_in_buckets = grads_in_buckets
        #: gradients copied into a bucket in the last step (module docstring)
        self.copies = 0
        #: parameters whose ``.grad`` this step's ``begin_step`` pointed at their bucket
        self.in_bucket: set = set()
        self._received: set = set()  # parameters autograd accumulated a gradient into this step
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        self._flat_view: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_view: dict[nn.Parameter, torch.Tensor] = {}
        self._copied: set = set()
        self._next = 0
        self.active = False
        self.overlapped = 0
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
            p.register_post_accumulate_grad_hook(self.mark_ready)

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

    def _is_view(self, p: nn.Parameter, grad: torch.Tensor) -> bool:
        view = self._grad_view[p]
        return (grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype and grad.shape == view.shape
                and grad.stride() == view.stride())

    def _aliases_bucket(self, p: nn.Parameter, grad: torch.Tensor) -> bool:
        flat = self._where[p][0].flat
        return grad.device == flat.device and grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()

    def begin_step(self) -> dict:
        """Before a step's first forward: take the synced parameters' gradients present off them and
        return them (parameter -> what to add back after the reduction: a copy where it lives in a
        bucket, nothing for an all-zero bucket view); then, with ``grads_in_buckets``, zero each bucket
        whose dtype is its parameters' and point their ``.grad`` at it (module docstring)."""
        stashed = {}
        for p in self._where:
            grad = p.grad
            if grad is None:
                continue
            if not self._aliases_bucket(p, grad):
                stashed[p] = grad
            elif not self._is_view(p, grad) or bool(grad.any()):
                stashed[p] = grad.clone()
            p.grad = None
        self.in_bucket, self._received, self.copies = set(), set(), 0
        if self.grads_in_buckets:
            with torch.no_grad():
                for b in self.buckets:
                    if all(p.dtype == b.dtype for p in b.params):
                        b.flat.zero_()
                        for p in b.params:
                            p.grad = self._grad_view[p]
                        self.in_bucket.update(b.params)
        return stashed

    def arm(self) -> None:
        """Call before the backward whose gradients are final: each one is then bucketed as it lands."""
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = None
        self._next = 0
        self._copied = set()
        self.active = True

    def mark_ready(self, p: nn.Parameter) -> None:
        """``p``'s gradient is final for this step: put it in its bucket (after ``arm``; nothing to copy
        where it accumulated there), launching what is full. The hooks call this (in every round: they
        note which parameters received a gradient), and a zero-bubble W for the gradients it sets
        without hooks."""
        self._received.add(p)
        if not self.active or p not in self._where or p in self._copied:
            return
        b, _ = self._where[p]
        self._bucket(p)
        self._copied.add(p)
        b.pending -= 1
        self._launch_ready()

    def _bucket(self, p: nn.Parameter) -> None:
        """Put ``p``'s gradient in its bucket: nothing to do where it is accumulated there already."""
        if not self._is_view(p, p.grad):
            self._flat_view[p].copy_(p.grad.reshape(-1))
            self.copies += 1

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            b.work = dist.all_reduce(b.flat, group=b.comm.group, async_op=True)
            self._next += 1

    def launch_rest(self) -> None:
        """Launch every bucket not launched yet, each gradient its bucket never got copied in whole
        (zeros for a parameter without a gradient)."""
        if self.active:
            self.overlapped = self._next
        self.active = False
        for b in self.buckets[self._next:]:
            for p in b.params:
                if p not in self._copied:
                    if p.grad is None:
                        self._flat_view[p].zero_()
                    else:
                        self._bucket(p)
                    self._copied.add(p)
            b.pending = 0
        self._launch_ready()

    def finish(self) -> None:
        """Call after backward: launch what is left (``launch_rest``), wait, and point every gradient at
        its reduced bucket."""
        self.launch_rest()
        for b in self.buckets:
            note(f"all_reduce of a gradient bucket ({b.flat.numel()} elements)", b.comm)
            b.work.wait()
            for p in b.params:
                if p in self.in_bucket and p not in self._received:
                    p.grad = None  # no gradient reached it in this step: None, as without the views
                if p.grad is None:
                    continue
                view = self._grad_view[p]
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
