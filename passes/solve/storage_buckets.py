"""The ZeRO parameters' reduction buckets, as the runtime forms them and as the plan prices them.

The runtime (``runtime.zero``) reduces the gradients of parameters in ZeRO forms
(``passes.sharding.storage_forms``) bucket by bucket, as DDP does its all-reduces: parameters in the
order their gradients become ready (reverse order of first use in the program), one open bucket per
``BucketKey`` (ZeRO axes, other replicated axes, reduce-once or not, dtypes), a bucket closed when the
next parameter would take it past ``bucket_bytes`` (of its gradient in the reduce dtype). Each bucket
is one reduce-scatter over its ZeRO axes flattened (once per step, or every microstep for ``zero2``),
one all-reduce of the reduced slices over the other axes (once per step), and, after the optimizer
step, one all-gather of the parameters over the ZeRO axes. ``zero_buckets`` is that rule, shared by
both sides; ``bucket_collectives`` prices each bucket's calls, so the plan's estimate counts the
collectives the step calls (the ILP prices each parameter's share: ``passes.cost.storage_prices``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from autoshard.passes.cost.collectives import Collective
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.sharding.storage_forms import StorageForm, form_of
from autoshard.passes.spec import Replicate, Strategy, TensorMeta

__all__ = ["BucketKey", "ready_order", "zero_buckets", "zero_members", "bucket_collectives"]


@dataclass(frozen=True)
class BucketKey:
    """What parameters of one bucket share: the ZeRO axes and the other replicated axes (size > 1),
    whether the bucket reduces once per step, the parameters' dtype and the reduce dtype (by name)."""
    zero_axes: tuple[int, ...]
    other_axes: tuple[int, ...]
    once: bool
    dtype: str
    reduce_dtype: str


def ready_order(captured: CapturedGraph) -> list[str]:
    """Parameter placeholders in the order their gradients become ready: reverse order of first use
    (a parameter no op reads last)."""
    first_use: dict[str, int] = {}
    for i, node in enumerate(captured.gm.graph.nodes):
        for a in node.all_input_nodes:
            if a.name in captured.params:
                first_use.setdefault(a.name, i)
    names = list(captured.params)
    return sorted(names, key=lambda n: -first_use.get(n, -1))


def zero_buckets(entries: Iterable[tuple[str, BucketKey, float]], bucket_bytes: float) -> list[tuple[BucketKey, list[str]]]:
    """``entries`` (name, key, gradient bytes in the reduce dtype), in ready order -> buckets, in the
    order they close (launch order); module docstring."""
    buckets: list[tuple[BucketKey, list[str]]] = []
    open_: dict[BucketKey, list] = {}  # key -> [index into buckets, bytes]
    for name, key, nbytes in entries:
        current = open_.get(key)
        if current is None or (current[1] and current[1] + nbytes > bucket_bytes):
            buckets.append((key, []))
            current = open_[key] = [len(buckets) - 1, 0.0]
        buckets[current[0]][1].append(name)
        current[1] += nbytes
    return buckets


def zero_members(captured: CapturedGraph, strategies: dict[str, Strategy], mesh_shape, reduce_dtype=None,
                 trainable=None) -> list[tuple[str, BucketKey, StorageForm, float]]:
    """(placeholder, key, form, gradient bytes per rank in the reduce dtype) of every trained parameter
    in a ZeRO form, in ready order. ``trainable(name)``: False for a frozen parameter (kept plain)."""
    out = []
    for name in ready_order(captured):
        meta: TensorMeta = captured.node(name).meta["autoshard.meta"]
        form = form_of(strategies[name], meta.shape, mesh_shape)
        if not form.zero or (trainable is not None and not trainable(name)):
            continue
        storage = strategies[name].outputs[0]
        others = tuple(a for a, p in enumerate(storage) if isinstance(p, Replicate) and mesh_shape[a] > 1
                       and a not in form.zero_axes)
        master = captured.master_dtypes.get(name, meta.dtype)
        reduce = reduce_dtype if reduce_dtype is not None and meta.dtype.is_floating_point else meta.dtype
        key = BucketKey(form.zero_axes, others, form.zero_reduced_once, str(master), str(reduce))
        out.append((name, key, form, float(_local_numel(captured, strategies, name, mesh_shape) * reduce.itemsize)))
    return out


def _local_numel(captured: CapturedGraph, strategies: dict, name: str, mesh_shape) -> int:
    meta = captured.node(name).meta["autoshard.meta"]
    storage = strategies[name].outputs[0]
    return meta.numel // math.prod(mesh_shape[a] for a, p in enumerate(storage) if not isinstance(p, Replicate))


def bucket_collectives(cm, captured: CapturedGraph, strategies: dict[str, Strategy], microsteps: int,
                       reduce_dtype=None) -> list[Collective]:
    """The collectives one step runs for the ZeRO parameters' buckets (module docstring), each priced
    by ``cm`` with one op launch: per bucket a reduce-scatter (``microsteps`` of them for a bucket reduced
    every microstep), an all-reduce when it has other replicated axes, and the all-gather after the step."""
    members = zero_members(captured, strategies, cm.mesh.shape, reduce_dtype)
    params = {name: (key, nbytes) for name, key, _, nbytes in members}
    out: list[Collective] = []
    launch = cm.hardware.op_overhead_s
    for key, names in zero_buckets(((n, k, b) for n, k, _, b in members), cm.grad_bucket_bytes):
        reduced = sum(params[n][1] for n in names)
        n = math.prod(cm.mesh.shape[a] for a in key.zero_axes)
        gathered = sum(_local_numel(captured, strategies, p, cm.mesh.shape) for p in names) * _itemsize(key.dtype)
        axis = key.zero_axes[0] if len(key.zero_axes) == 1 else key.zero_axes
        scatter = Collective("reduce_scatter", axis, int(reduced),
                             cm.flat_collective_time("reduce_scatter", key.zero_axes, reduced) + launch, "bwd")
        out.extend([scatter] * (1 if key.once else microsteps))
        if key.other_axes:
            out.append(Collective("all_reduce", key.other_axes[0] if len(key.other_axes) == 1 else key.other_axes,
                                  int(reduced / n), cm.flat_collective_time("all_reduce", key.other_axes, reduced / n)
                                  + launch, "bwd"))
        out.append(Collective("all_gather", axis, int(gathered),
                              cm.flat_collective_time("all_gather", key.zero_axes, gathered) + launch, "step"))
    return out


def _itemsize(dtype_name: str) -> int:
    import torch
    return getattr(torch, dtype_name.replace("torch.", "")).itemsize
