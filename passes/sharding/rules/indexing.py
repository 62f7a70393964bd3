"""Sharding rules for ops that pick elements by position: sort/topk, gather/scatter, advanced indexing.

- ``topk``/``sort``/``argsort``: every dim but the sorted one shards; values and indices follow.
- ``gather(self, dim, index)``: on a dim other than ``dim``, ``self`` and ``index`` shard together
  where their sizes match (positions then line up rank by rank); along ``dim`` the index may shard
  alone (``self`` whole), the output following the index. Linear in ``self``: ``(P, R) -> P``.
- ``scatter``/``scatter_add``/``scatter_reduce``: ``self``, ``index`` and ``src`` shard together on a
  dim other than ``dim`` where all their sizes match. ``scatter_add`` is linear: ``(P, R, P) -> P``.
- ``index.Tensor(self, [i0, None, ...])``: ``self`` shards on dims no index touches (indices whole),
  or the indices shard on a dim of their broadcast shape (``self`` whole). Boolean masks give a
  data-dependent shape and stay replicated.
- ``index_put``: only the clearly safe cases: an unindexed dim of ``self`` with ``values`` split
  to match (or broadcast), and ``accumulate=True`` with ``self`` and ``values`` partial.
- ``masked_select``: replicated only (data-dependent output length).

>>> # gather(x: (4, 6, 8), 2, idx: (4, 6, 2)):  S(0): (S(0), S(0)) -> S(0);  S(2): (R, S(2)) -> S(2)
"""
from __future__ import annotations

from typing import Optional

import torch

from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.passes.sharding.rules.common import broadcast_placement, norm_dim, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["sort_rule", "gather_rule", "scatter_rule", "index_rule", "index_put_rule", "masked_select_rule",
           "index_layout"]


@register_rule(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
               aten.argsort.stable, float_partials_only=True)
def sort_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    n_out = len(call.outputs)
    return [Strategy1D((Shard(d),), (Shard(d),) * n_out) for d in split_dims(x.shape) if d != dim]


@register_rule(aten.gather.default, float_partials_only=True)
def gather_rule(call: OpCall) -> list[Strategy1D]:
    x, idx = call.inputs
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    found = []
    for d in split_dims(idx.shape):
        if d == dim:
            found.append(Strategy1D((R, Shard(d)), (Shard(d),)))
        elif x.shape[d] == idx.shape[d]:
            found.append(Strategy1D((Shard(d), Shard(d)), (Shard(d),)))
    return found + [Strategy1D((P, R), (P,))]


_LINEAR_SCATTERS = {"scatter_add", "scatter_add_"}


@register_rule(aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce,
               aten.scatter_reduce_, float_partials_only=True)
def scatter_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    n_in = len(call.inputs)
    found = []
    for d in split_dims(x.shape):
        if d != dim and all(m.shape[d] == x.shape[d] for m in call.inputs):
            found.append(Strategy1D((Shard(d),) * n_in, (Shard(d),)))
    name = call.op_name
    if name in _LINEAR_SCATTERS and n_in == 3:
        found.append(Strategy1D((P, R, P), (P,)))
    return found


def index_layout(ndim: int, indices: list[Optional[TensorMeta]]) -> tuple[dict[int, int], list[int], tuple[int, ...]]:
    """Where ``x[indices]`` puts things: ({unindexed self dim: output dim}, output dims of the
    broadcast index shape, broadcast index shape). Adjacent indexed dims put the index dims where
    the first indexed dim was; separated ones put them first (numpy's rule).

    >>> # x: 3-d, indices [None, i (5,)]  ->  ({0: 0, 2: 2}, [1], (5,))
    """
    indexed = [i for i, t in enumerate(indices) if t is not None]
    bshape = tuple(torch.broadcast_shapes(*(tuple(indices[i].shape) for i in indexed)))
    unindexed = [d for d in range(ndim) if d not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[0] + len(indexed)))
    start = indexed[0] if adjacent else 0
    index_dims = list(range(start, start + len(bshape)))
    self_map = {}
    for rank, d in enumerate(unindexed):
        if adjacent:
            self_map[d] = d if d < start else d - len(indexed) + len(bshape)
        else:
            self_map[d] = len(bshape) + rank
    return self_map, index_dims, bshape


def _index_metas(call: OpCall) -> Optional[list[Optional[TensorMeta]]]:
    indices = list(call.bound_args["indices"])
    if not any(isinstance(t, TensorMeta) for t in indices):
        return None
    if any(isinstance(t, TensorMeta) and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return None  # a mask: the output length depends on the data
    return [t if isinstance(t, TensorMeta) else None for t in indices]


@register_rule(aten.index.Tensor, float_partials_only=True)
def index_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    indices = _index_metas(call)
    if indices is None:
        return []
    idx = [t for t in indices if t is not None]
    self_map, index_dims, bshape = index_layout(len(x.shape), indices)
    whole = (R,) * len(idx)
    found = [Strategy1D((Shard(d),) + whole, (Shard(o),)) for d, o in self_map.items() if x.shape[d] > 1]
    for b, o in enumerate(index_dims):
        if bshape[b] > 1:
            ins = tuple(broadcast_placement(t, b, len(bshape)) for t in idx)
            found.append(Strategy1D((R,) + ins, (Shard(o),)))
    return found + [Strategy1D((P,) + whole, (P,))]


@register_rule(aten.index_put.default, aten.index_put_.default, float_partials_only=True)
def index_put_rule(call: OpCall) -> list[Strategy1D]:
    x, values = call.inputs[0], call.inputs[-1]
    indices = _index_metas(call)
    if indices is None:
        return []
    whole = (R,) * (len(call.inputs) - 2)
    self_map, index_dims, _ = index_layout(len(x.shape), indices)
    result_ndim = len(self_map) + len(index_dims)
    found = []
    for d, o in self_map.items():
        if x.shape[d] > 1:
            found.append(Strategy1D((Shard(d),) + whole + (broadcast_placement(values, o, result_ndim),),
                                    (Shard(d),)))
    if call.bound_args.get("accumulate"):
        found.append(Strategy1D((P,) + whole + (P,), (P,)))
    return found


@register_rule(aten.masked_select.default, float_partials_only=True)
def masked_select_rule(call: OpCall) -> list[Strategy1D]:
    return []
