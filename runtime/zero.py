"""ZeRO-1 and ZeRO-2 in the runtime: the optimizer steps this rank's slice of each replicated parameter.

A parameter in a ZeRO form (``passes.sharding.storage_forms``: ``zero1`` / ``zero2`` on some of its
``R`` axes) is held whole, and the program computes with it as with any replicated parameter. What
differs is what the optimizer sees and how the gradient is reduced:

- ``ZeroSync.optimizer_parameter(p)`` is this rank's slice of ``p`` along ``StorageForm.zero_dim``
  over the ZeRO axes flattened: an ``nn.Parameter`` that is a *view* of ``p``'s storage, so
  ``RankProgram.parameters()`` hands it to the optimizer in ``p``'s place and ``optimizer.step()``
  updates ``p``'s slice in place. The optimizer's state is made for the slice: ``1 / z`` of it per rank;
- gradients are bucketed in the order they become ready (``passes.solve.storage_buckets``, the rule
  the plan prices); a post-accumulate-grad hook copies each gradient, laid out as the slices of every
  rank, into its bucket and frees it; a full bucket is reduce-scattered over the ZeRO axes (async,
  launched strictly in bucket order on every rank; at most one in flight, so at most two bucket
  buffers are alive: one reducing, the next filling). ``zero2`` buckets do this every microstep of an
  accumulated step; ``zero1`` buckets only in the last one (the earlier microsteps' gradients
  accumulate whole in ``p.grad``, unreduced). The reduced slices accumulate over the microsteps in
  one buffer per bucket; after the last microstep it is all-reduced over the parameter's other ``R``
  axes and becomes the slices' ``.grad`` (gradients already there when the step began are kept and
  added to, as ``gradsync`` does);
- after ``optimizer.step()`` the whole parameters are stale except for this rank's slice:
  ``gather()`` all-gathers them, one bucket at a time (once per step: the executor calls it before
  the next forward, and before a state dict is read). A bucket is gathered only when one of its
  slices was written since its last gather (their version counters, which the optimizer's in-place
  update bumps), so every rank must step the same parameters, as with any data-parallel optimizer.

One ``ZeroSync`` per stage of a rank's program (``runtime.executor``), over the stage's (sub)mesh:
a "microstep" is one weight action of the stage (its BW, or a zero-bubble W, whose gradients land
without autograd's hook and are handed over by ``ready``), so under a pipeline ``zero2`` buckets
reduce-scatter once per microbatch of every round and ``zero1`` buckets once, in the stage's last
weight action of the step; without a pipeline a round is one microstep, as before.

Every rank issues the same collectives in the same order. ``calls`` counts them by kind.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.passes.sharding.storage_forms import StorageForm
from autoshard.passes.solve.storage_buckets import BucketKey, zero_buckets, zero_members

from .collectives import AxisComm, start_flat_gather, start_flat_reduce_scatter

__all__ = ["ZeroSync", "zero_sync_for"]


@dataclass(eq=False)
class _Member:
    """One parameter: ``param`` whole, ``shard`` this rank's slice of it (a view); ``pre`` / ``post``: the
    dims before / after ``dim``; ``chunk``: the slice's size along ``dim``."""
    name: str
    param: nn.Parameter
    shard: nn.Parameter
    dim: int
    chunk: int
    offset: int = 0

    @property
    def pre(self) -> tuple:
        return tuple(self.param.shape[:self.dim])

    @property
    def post(self) -> tuple:
        return tuple(self.param.shape[self.dim + 1:])

    @property
    def numel(self) -> int:
        return self.shard.numel()


@dataclass(eq=False)
class _Bucket:
    key: BucketKey
    zero: AxisComm
    other: Optional[AxisComm]
    reduce_dtype: torch.dtype
    members: list[_Member]
    numel: int = 0  # of the slices, summed
    armed: bool = False
    pending: int = 0
    rows: Optional[torch.Tensor] = None  # (ranks, numel): every rank's slices, being filled
    acc: Optional[torch.Tensor] = None  # this rank's reduced slices, summed over the step's microsteps
    launched: Optional[tuple] = None  # (output, work) of the reduce-scatter in flight
    versions: list = field(default_factory=list)
    filled: set = field(default_factory=set)  # members whose gradient this microstep copied in


class ZeroSync:
    """The ZeRO parameters of one program (module docstring). ``members``: (placeholder, parameter,
    ``StorageForm``, ``BucketKey``, gradient bytes) in the order gradients become ready
    (``storage_buckets.zero_members``); ``comm_for(axes)``: a communicator over mesh axes flattened;
    ``reduce_dtype``: the dtype buckets reduce in (None: each parameter's)."""

    def __init__(self, members: list[tuple[str, nn.Parameter, StorageForm, BucketKey, float]],
                 comm_for: Callable, *, bucket_bytes: int = 25 * 2**20, reduce_dtype: Optional[torch.dtype] = None):
        by_name = {}
        for name, param, form, key, nbytes in members:
            comm = comm_for(form.zero_axes)
            n, d = comm.size, form.zero_dim
            chunk = param.shape[d] // n
            shard = nn.Parameter(param.detach().narrow(d, comm.rank * chunk, chunk), requires_grad=param.requires_grad)
            by_name[name] = (_Member(name, param, shard, d, chunk), comm, key, nbytes)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[nn.Parameter, tuple[_Bucket, _Member]] = {}
        for key, names in zero_buckets(((n, by_name[n][2], by_name[n][3]) for n, *_ in members), bucket_bytes):
            zero = by_name[names[0]][1]
            other = comm_for(key.other_axes) if key.other_axes else None
            dtype = reduce_dtype or by_name[names[0]][0].param.dtype
            b = _Bucket(key, zero, other, dtype, [])
            for name in names:
                m = by_name[name][0]
                m.offset = b.numel
                b.numel += m.numel
                b.members.append(m)
                self._bucket_of[m.param] = (b, m)
            b.versions = [m.shard._version for m in b.members]
            self.buckets.append(b)
        self._shards = {m.param: m.shard for b in self.buckets for m in b.members}
        self._next = 0
        self._in_flight: Optional[_Bucket] = None
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self.active = False
        #: the bucket's rows are reduced in place where the backend's reduce-scatter would copy them
        #: (``collectives.start_flat_reduce_scatter(consume=True)``: gloo)
        self.reduce_in_place = True
        self.calls: Counter = Counter()
        #: the parameters the optimizer steps a slice of (whole parameter -> its slice)
        self.shards = self._shards
        #: slice -> its gradient before this step, where one was present (accumulation across steps)
        self.carried: dict[nn.Parameter, torch.Tensor] = {}
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._ready)

    # ---- what the optimizer sees -------------------------------------------------------------------
    def optimizer_parameter(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter the optimizer steps in ``param``'s place: its slice, or ``param`` itself."""
        return self._shards.get(param, param)

    @property
    def num_params(self) -> int:
        return len(self._shards)

    # ---- a step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before a step's first microstep: gather what the optimizer changed, set aside the slices'
        gradients already present (added back after the reduction; ``carried`` keeps them for the step)."""
        self.gather()
        self.carried = {}
        self._stash = {m.shard: m.shard.grad for b in self.buckets for m in b.members if m.shard.grad is not None}
        for shard in self._stash:
            shard.grad = None
        for b in self.buckets:
            b.acc = None

    def arm(self, last: bool) -> None:
        """Before a microstep's backward: ``zero2`` buckets reduce every microstep, ``zero1`` ones in
        the ``last`` only."""
        for b in self.buckets:
            b.armed = last or not b.key.once
            b.pending = len(b.members) if b.armed else 0
            b.filled = set()
        self._next = 0
        self.active = any(b.armed for b in self.buckets)

    def ready(self, p: nn.Parameter) -> None:
        """``p``'s gradient of this microstep landed without autograd's hook (a zero-bubble W sets it
        directly, ``SplitBackward.weight_grads``): bucket it as the hook would. Any parameter may be
        passed; one not in a ZeRO form, or already bucketed this microstep, is left alone."""
        if p in self._bucket_of:
            self._ready(p)

    def _ready(self, p: nn.Parameter) -> None:
        b, m = self._bucket_of[p]
        if not (self.active and b.armed) or p.grad is None:
            return
        self._rows_of(b, m).copy_(self._as_slices(p.grad, m))
        p.grad = None
        b.filled.add(m)
        b.pending -= 1
        self._launch_ready()

    def finish(self, last: bool) -> None:
        """After a microstep's backward: reduce what is left (zeros for gradients that never came); in
        the ``last`` microstep, all-reduce each bucket's slices over its other axes and set the slices'
        gradients."""
        for b in self.buckets:
            if b.armed and b.pending:
                for m in b.members:
                    if m not in b.filled:  # a gradient that never came
                        self._rows_of(b, m).zero_()
                b.pending = 0
        self._launch_ready()
        self._drain()
        self.active = False
        if last:
            for b in self.buckets:
                self._publish(b)
            self._stash.clear()

    def _rows_of(self, b: _Bucket, m: _Member) -> torch.Tensor:
        """Member ``m``'s columns of ``b``'s rows, shaped ``(ranks, *pre, chunk, *post)``."""
        n = b.zero.size
        if b.rows is None:
            b.rows = torch.empty((n, b.numel), dtype=b.reduce_dtype, device=m.param.device)
        return b.rows[:, m.offset:m.offset + m.numel].view((n,) + m.pre + (m.chunk,) + m.post)

    @staticmethod
    def _as_slices(grad: torch.Tensor, m: _Member) -> torch.Tensor:
        """``grad`` viewed as every rank's slice: ``(ranks, *pre, chunk, *post)``."""
        n = grad.shape[m.dim] // m.chunk
        return grad.reshape(m.pre + (n, m.chunk) + m.post).movedim(len(m.pre), 0)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.armed and b.pending:
                return
            self._next += 1
            if not b.armed or b.rows is None:
                continue
            self._drain()  # at most one in flight: the previous bucket's buffers go before the next fills
            b.launched = start_flat_reduce_scatter(b.rows.view(-1), b.zero, consume=self.reduce_in_place)
            self.calls["reduce_scatter"] += 1
            self._in_flight = b

    def _drain(self) -> None:
        b, self._in_flight = self._in_flight, None
        if b is None:
            return
        out, work = b.launched
        work.wait()
        b.launched, b.rows = None, None
        if b.acc is None:  # a view of the rows (``consume``) is cloned, so they go
            b.acc = out if out._base is None else out.clone()
        else:
            b.acc.add_(out)

    def _publish(self, b: _Bucket) -> None:
        if b.acc is None:
            return
        if b.other is not None and b.other.size > 1:
            dist.all_reduce(b.acc, group=b.other.pg(), async_op=True).wait()
            self.calls["all_reduce"] += 1
        for m in b.members:
            piece = b.acc[m.offset:m.offset + m.numel].view(m.pre + (m.chunk,) + m.post).to(m.shard.dtype)
            before = self._stash.get(m.shard)
            if before is not None:  # what the step added is ``grad - carried[shard]`` (tied weights sum only that)
                self.carried[m.shard] = before.clone()
            m.shard.grad = piece if before is None else before.add_(piece)
        b.acc = None

    # ---- after the optimizer step ------------------------------------------------------------------
    def gather(self) -> None:
        """All-gather the whole parameters of every bucket whose slices changed since its last gather
        (module docstring), one bucket at a time."""
        with torch.no_grad():
            for b in self.buckets:
                if [m.shard._version for m in b.members] == b.versions:
                    continue
                n = b.zero.size
                flat = torch.cat([m.shard.detach().reshape(-1) for m in b.members])
                out, work = start_flat_gather(flat, b.zero)
                work.wait()
                self.calls["all_gather"] += 1
                rows = out.view(n, b.numel)
                for m in b.members:
                    whole = m.param.detach().view(m.pre + (n, m.chunk) + m.post)
                    part = rows[:, m.offset:m.offset + m.numel].view((n,) + m.pre + (m.chunk,) + m.post)
                    whole.copy_(part.movedim(0, len(m.pre)))
                b.versions = [m.shard._version for m in b.members]



def zero_sync_for(captured, strategies: dict, mesh_shape, params: dict[str, nn.Parameter], comm_for: Callable, *,
                  reduce_dtype: Optional[torch.dtype] = None, bucket_bytes: int = 25 * 2**20) -> Optional[ZeroSync]:
    """The ``ZeroSync`` of a program's trained parameters in ZeRO forms (``params``: placeholder -> its
    local parameter), or None when it has none (a forward-only program has none)."""
    if not captured.training:
        return None
    members = zero_members(captured, strategies, mesh_shape, reduce_dtype, lambda ph: params[ph].requires_grad)
    if not members:
        return None
    return ZeroSync([(name, params[name], form, key, nbytes) for name, key, form, nbytes in members], comm_for,
                    bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)
