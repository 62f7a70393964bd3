"""Parameter copies: each parameter gathered (and cast) from its stored shard to what the ops need,
one block at a time, as FSDP2 does; optionally freed after forward and gathered again for backward.

The lowering (``lower``) groups every (parameter, placement) whose storage differs from what an op
needs, or that mixed precision casts, by the block segment of its first use (a block instance, or
the ops before / after / between blocks) and emits one call per group::

    gather_params = runtime_param_gather_gather_params(param_gatherer, 2, (p_o, p_fc), p_q, p_k, p_v)
    getitem = gather_params[0]; ...

(group 2; the next group's shards, in a tuple autograd does not track, read for the forward
prefetch only; then the group's own shards).
``ParamGatherer`` (the program's ``param_gatherer`` attribute) runs it:

- members whose redistribution is one all-gather of one dim over the same mesh axes (FSDP's case)
  travel in ONE flat collective per (axes, dtype): shards cast to the compute dtype, flattened and
  concatenated, gathered, copied out per parameter; other members run their steps one by one;
- forward prefetch: a group's call starts the next group's flat gathers (async), so they overlap the
  block's compute; that group's call waits for them (and gathers again if a shard changed since:
  its shards are matched by memory and version, not as Python objects, since a checkpoint's
  recomputation hands them back as new tensor objects over the same storage);
- autograd: backward casts each copy's gradient to ``reduce_dtype``, reduce-scatters it (one flat
  collective per fused set; the adjoint steps otherwise) and returns it in the shard's own dtype;
- reshard after forward: under ``saved_tensors_hooks()`` (the forward), a tensor autograd saves whose
  storage is a registered copy of a resharding group is packed as a handle (group, member, view
  geometry); unpacking gathers the group again (kept until its handles are all unpacked) and starts
  the re-gather of the previous group that backward will need (backward prefetch). A checkpointed
  block re-runs its group call during recomputation (``recompute.rerunning()``): it gathers again
  and prefetches backward too, and never prefetches forward;
- memory: every copy is registered by a weak reference to its storage: ``alive_bytes()`` (the
  copies alive, plus the flat buffers of prefetches in flight: the next block's gathered weights
  exist before its copies do) and ``peak_bytes`` (the most such bytes at once since ``reset_peak``,
  sampled after each group call has started its prefetch).

Every rank runs the same groups in the same order, so the collectives match across ranks.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autoshard.passes.layout.gathers import fused_gather

from .collectives import AxisComm, flat_reduce_scatter, raw_adjoint, raw_step, start_flat_gather
from .recompute import outside_selective_checkpoint, rerunning
from .redistribute import Step, step_call

__all__ = ["CopyRecipe", "GatherGroup", "ParamGatherer", "gather_params"]


@dataclass(frozen=True)
class CopyRecipe:
    """How one parameter's copy is made: cast the shard to ``dtype`` (the compute dtype; a no-op when
    it already is), then run ``steps`` (``redistribute.plan_redistribute`` from storage to need)."""
    placeholder: str
    steps: tuple[Step, ...]
    dtype: torch.dtype
    held: bool = False  # storage form ``once``: the copy's gradient is held over the microsteps, reduced after the last

    def fused_gather(self) -> Optional[tuple[tuple[int, ...], int]]:
        """(mesh axes, tensor dim) when the copy is one flat gather (``passes.layout.gathers.fused_gather``)."""
        return fused_gather(self.steps)


@dataclass
class GatherGroup:
    """One call's members, in order. ``block``: the block instance of its first use (None outside
    blocks). ``reshard``: saved copies are packed as handles (reshard after forward). ``regathers``:
    backward needs the copies again (reshard, or the block is recomputed)."""
    index: int
    block: Optional[str]
    members: list[CopyRecipe]
    reshard: bool = False
    regathers: bool = False


@dataclass(frozen=True)
class _Fused:
    comm: AxisComm
    dtype: torch.dtype
    members: tuple[int, ...]
    dims: tuple[int, ...]
    held: bool = False


@dataclass(eq=False)
class _Pending:
    """Flat gathers started ahead: (output, work) per fused set, for these shards at these versions."""
    shards: tuple
    versions: tuple
    sets: list

    def matches(self, shards) -> bool:
        """Whether ``shards`` are the values this prefetch gathered: the same tensors, or other tensor
        objects over the same memory (a checkpoint's recomputation gets its inputs back as new
        objects), none written since the gather started."""
        return (len(shards) == len(self.shards)
                and all(_same_memory(a, b) for a, b in zip(self.shards, shards))
                and all(a._version == v and (b is a or b._version == v)
                        for a, b, v in zip(self.shards, shards, self.versions)))

    def wait(self) -> None:
        for _, work in self.sets:
            work.wait()


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a resharded copy (or a view of one)."""
    group: int
    member: int
    size: tuple
    stride: tuple
    offset: int


@dataclass(eq=False)
class _Copy:
    ref: Any  # StorageWeakRef
    nbytes: int
    group: int
    member: int


class ParamGatherer:
    """Runs the gather groups of one rank's program (see the module docstring). ``comm_for(axes)``
    gives the communicator of mesh axes (``MeshEnv.comm_for``); ``reduce_dtype``: gradients are
    reduced in it (None: in the compute dtype)."""

    def __init__(self, groups: list[GatherGroup], comm_for, reduce_dtype: Optional[torch.dtype] = None):
        self.groups = groups
        self.reduce_dtype = reduce_dtype
        self._comm_for = comm_for
        self._fused: list[list[_Fused]] = []
        self._loose: list[list[int]] = []
        for g in groups:
            sets: dict[tuple, list[int]] = {}
            loose = []
            for k, r in enumerate(g.members):
                fused = r.fused_gather()
                if fused is None:
                    loose.append(k)
                else:
                    sets.setdefault((fused[0], r.dtype, r.held), []).append(k)
            self._fused.append([_Fused(comm_for(axes), dtype, tuple(ks),
                                       tuple(g.members[k].fused_gather()[1] for k in ks), held)
                                for (axes, dtype, held), ks in sets.items()])
            self._loose.append(loose)
        self.backward_next: list[Optional[int]] = []
        for i in range(len(groups)):
            prev = [j for j in range(i) if groups[j].regathers and self._fused[j]]
            self.backward_next.append(prev[-1] if prev else None)
        self._pending: dict[int, _Pending] = {}
        self._shards: dict[int, tuple] = {}
        self._regathered: dict[int, list] = {}
        self._handles_left: dict[int, int] = {}
        self._copies: dict[int, _Copy] = {}
        self.peak_bytes = 0
        self.regathered = 0  # groups gathered again in backward (reshard after forward), in all
        # storage form ``once``: the gradients held over an accumulated step's microsteps, by (group,
        # fused set) or (group, loose member); ``final``: the executor sets it in the last microstep
        self._held: dict[tuple, torch.Tensor] = {}
        self.final = True
        self.held = 0  # gradients held over a microstep instead of reduced, in all

    @property
    def reshards(self) -> bool:
        return any(g.reshard for g in self.groups)

    # ---- step boundaries -------------------------------------------------------------------------
    def begin(self) -> None:
        """Before a forward: forget the last run's prefetches, shards and re-gathered copies."""
        self.end()

    def begin_step(self) -> None:
        """Before an accumulated step's first microstep: drop any held gradients a failed step left."""
        self._held.clear()
        self.final = True

    def end(self) -> None:
        """After a backward: wait for and drop any prefetch backward did not use."""
        for pending in self._pending.values():
            pending.wait()
        self._pending.clear()
        self._shards.clear()
        self._regathered.clear()
        self._handles_left.clear()

    def saved_tensors_hooks(self):
        """The context to run the forward in: packs saved copies of resharding groups as handles."""
        if not self.reshards:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ---- memory ------------------------------------------------------------------------------------
    def alive_bytes(self) -> int:
        """Bytes of parameter copies alive now, and of the prefetched flat gathers in flight."""
        dead = [c for c, e in self._copies.items() if e.ref.expired()]
        for c in dead:
            del self._copies[c]
        in_flight = sum(out.untyped_storage().nbytes() for p in self._pending.values() for out, _ in p.sets)
        return sum(e.nbytes for e in self._copies.values()) + in_flight

    def reset_peak(self) -> None:
        self.peak_bytes = self.alive_bytes()

    def copy_keys(self) -> set:
        """Keys (``StorageWeakRef.cdata``) of the parameter copies alive now."""
        self.alive_bytes()
        return set(self._copies)

    def _register(self, index: int, copies: list) -> None:
        for k, c in enumerate(copies):
            storage = c.untyped_storage()
            ref = StorageWeakRef(storage)
            self._copies[ref.cdata] = _Copy(ref, storage.nbytes(), index, k)
        self.peak_bytes = max(self.peak_bytes, self.alive_bytes())

    # ---- the group call --------------------------------------------------------------------------
    def produce(self, index: int, own: tuple, following: tuple) -> list:
        """The copies of group ``index`` from its shards ``own`` (the forward of ``gather_params``)."""
        backward = rerunning()
        if not backward:
            self._shards[index] = own
        copies = self._finish(index, own)
        if backward:
            self._prefetch_backward(index)
        elif index + 1 < len(self.groups) and following and self._fused[index + 1]:
            self._pending[index + 1] = self._start(index + 1, following)
        self._register(index, copies)
        return copies

    def _start(self, index: int, shards: tuple) -> _Pending:
        sets = []
        for f in self._fused[index]:
            pieces = [shards[k].detach().to(f.dtype).movedim(d, 0).reshape(-1) for k, d in zip(f.members, f.dims)]
            sets.append(start_flat_gather(torch.cat(pieces), f.comm))
        return _Pending(tuple(shards), tuple(s._version for s in shards), sets)

    def _finish(self, index: int, shards: tuple) -> list:
        pending = self._pending.pop(index, None)
        if pending is not None and not pending.matches(shards):
            pending.wait()
            pending = None
        if pending is None:
            pending = self._start(index, shards)
        members = self.groups[index].members
        copies: list = [None] * len(members)
        for f, (out, work) in zip(self._fused[index], pending.sets):
            work.wait()
            n = f.comm.size
            # out holds every rank's flat shards in rank order: member k's rows of rank r are
            # out[r, offset_k : offset_k + numel_k]; one fused copy puts each member's in place
            pieces = [out.new_empty((n, shards[k].numel())) for k in f.members]
            torch.split_with_sizes_copy(out.view(n, -1), [p.shape[1] for p in pieces], dim=1, out=pieces)
            for k, d, piece in zip(f.members, f.dims, pieces):
                moved = shards[k].movedim(d, 0).shape
                full = piece.view((n * moved[0],) + tuple(moved[1:]))
                copies[k] = full.movedim(0, d).contiguous() if d else full
        for k in self._loose[index]:
            x = shards[k].detach().to(members[k].dtype)
            for step in members[k].steps:
                _, static = step_call(step)
                x = raw_step(x, step.kind, static, self._comm_for((step.axis,)))
            if x.untyped_storage().data_ptr() == shards[k].untyped_storage().data_ptr():
                x = x.clone()  # a copy, never the shard itself (no cast needed, R -> P on coordinate 0)
            copies[k] = x
        return copies

    def reduce(self, index: int, grads: tuple, shards_meta: list, needs: tuple) -> list:
        """The shards' gradients from the copies' (the backward of ``gather_params``)."""
        members = self.groups[index].members
        out: list = [None] * len(members)
        for f in self._fused[index]:
            ks = [(k, d) for k, d in zip(f.members, f.dims) if needs[k]]
            if not ks:
                continue
            n = f.comm.size
            dtype = self.reduce_dtype or f.dtype
            sizes = [math.prod(shards_meta[k][1]) for k, _ in ks]
            device = shards_meta[ks[0][0]][2]
            rows = [grads[k].to(dtype).movedim(d, 0).reshape(n, numel) if grads[k] is not None
                    else torch.zeros((n, numel), dtype=dtype, device=device) for (k, d), numel in zip(ks, sizes)]
            flat = self._hold((index, f), torch.cat(rows, dim=1).view(-1)) if f.held else torch.cat(rows, dim=1).view(-1)
            if flat is None:
                continue  # held until the last microstep
            reduced = flat_reduce_scatter(flat, f.comm)
            offset = 0
            for (k, d), numel in zip(ks, sizes):
                master_dtype, shape, _ = shards_meta[k]
                moved = (shape[d],) + shape[:d] + shape[d + 1:]
                piece = reduced[offset:offset + numel].view(moved).movedim(0, d)
                out[k] = piece.to(master_dtype).contiguous()
                offset += numel
        for k in self._loose[index]:
            if not needs[k]:
                continue
            master_dtype = shards_meta[k][0]
            g = grads[k]
            g = g.to(self.reduce_dtype or members[k].dtype) if g is not None else None
            if g is not None and members[k].held:
                g = self._hold((index, k), g)
            if g is None:
                continue
            for step in reversed(members[k].steps):
                _, static = step_call(step)
                g = raw_adjoint(g, step.kind, static, self._comm_for((step.axis,)))
            out[k] = g.to(master_dtype)
        return out

    def _hold(self, key: tuple, value: torch.Tensor) -> Optional[torch.Tensor]:
        """Storage form ``once``: before the last microstep add ``value`` to what is held under ``key``
        (None: nothing to reduce yet); in the last, the sum of it all."""
        held = self._held.pop(key, None)
        total = value if held is None else held.add_(value)
        if self.final:
            return total
        self._held[key] = total if held is not None else total.clone()
        self.held += 1
        return None

    # ---- reshard after forward -------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        entry = self._copies.get(key) if key is not None else None
        if entry is None or entry.ref.expired() or not self.groups[entry.group].reshard:
            return t
        self._handles_left[entry.group] = self._handles_left.get(entry.group, 0) + 1
        return _Handle(entry.group, entry.member, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        copies = self._regather(packed.group)
        left = self._handles_left.get(packed.group, 0) - 1
        self._handles_left[packed.group] = left
        if left <= 0:
            self._regathered.pop(packed.group, None)
        return copies[packed.member].as_strided(packed.size, packed.stride, packed.offset)

    def _regather(self, index: int) -> list:
        copies = self._regathered.get(index)
        if copies is None:
            shards = self._shards.get(index)
            if shards is None:
                raise RuntimeError(f"parameter group {index} was resharded after a forward that is no longer "
                                   "current: run backward before the next forward of this program")
            with torch.no_grad():
                copies = self._finish(index, shards)
            self.regathered += 1
            self._regathered[index] = copies
            self._prefetch_backward(index)
            self._register(index, copies)
        return copies

    def _prefetch_backward(self, index: int) -> None:
        j = self.backward_next[index]
        if j is None or j in self._pending or j in self._regathered or j not in self._shards:
            return
        self._pending[j] = self._start(j, self._shards[j])


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements of the same storage (the same tensor, or aliases)."""
    if a is b:
        return True
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
        return None


class _GatherGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gatherer: ParamGatherer, index: int, following: tuple, *own):
        ctx.gatherer, ctx.index = gatherer, index
        ctx.shards_meta = [(s.dtype, tuple(s.shape), s.device) for s in own]
        # its ops differ between forward and recomputation; its copies are never kept by selective
        # checkpointing anyway (recomputing gathers again)
        with outside_selective_checkpoint():
            return tuple(gatherer.produce(index, own, following))

    @staticmethod
    def backward(ctx, *grads):
        out = ctx.gatherer.reduce(ctx.index, grads, ctx.shards_meta, ctx.needs_input_grad[3:])
        return (None, None, None, *out)


def gather_params(gatherer: ParamGatherer, index: int, following: tuple, *own: torch.Tensor) -> tuple:
    """Group ``index``'s copies (a tuple, in member order) from its shards ``own``. ``following``: the
    next group's shards, for the forward prefetch; inside a tuple, autograd does not count this call
    among their users (their gradients would otherwise wait for this group's backward)."""
    return _GatherGroup.apply(gatherer, index, tuple(following), *own)
