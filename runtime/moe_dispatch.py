"""Expert parallelism at run time: the ``expert_dispatch`` lowering of ``autoshard::moe_experts``.

The op's experts (dim 0 of ``gate``, ``up``, ``down``) are sharded over the lowering's mesh axes.
Each such axis plays one of two roles, read from the strategy's placement of ``hidden`` there:

- *dispatch* (tokens ``S(0)``): tokens travel to their experts' ranks and back, by an uneven
  all-to-all whose split sizes are exchanged first (``exchange_routes``; every routed pair is
  computed, none dropped). Output ``S(0)``.
- *filter* (tokens ``R``): every rank holds every token; each computes only the pairs routed to its
  own experts. Output ``P`` (the ranks' sums add up to the layer's output).

Emitted per MoE layer (dispatch axes flattened into one group, row-major as ``MeshEnv.comm_for``):

    order, send = moe_route(top_k_index, ...)                       # pairs for this group, by destination
    recv, expert_ids = exchange_routes(top_k_index, order, send, comm)    # split sizes and expert ids
    rows = all_to_all_v(moe_gather(hidden, order, k), send, recv, comm)  # dispatch
    y = local_experts(rows, expert_ids, None, gate, up, down, act, first_expert)   # recomputed in backward
    back = all_to_all_v(y, recv, send, comm)                        # combine
    out = moe_combine(back, order, top_k_weights, tokens, k, dtype)

so a layer's forward has one ``exchange_routes`` and one pair of ``all_to_all_v``; the backward runs
the adjoint pair (``all_to_all_v`` with the split sizes swapped). With filter axes only, the layer is
``local_experts`` on this rank's experts, no communication.

With a capacity factor (lowering ``expert_dispatch_capacity``) shapes are static instead: each rank
fills a send buffer of ``(group, E_local, C)`` rows, ``C = capacity_rows(T_local * k, E, factor)``
(``capacity_slots``: a pair beyond its expert's ``C`` rows from this rank is dropped), and one pair
of even ``all_to_all`` moves the buffers there and back; the experts run as batched GEMMs over
their ``group * C`` received rows (``capacity_experts``); no route exchange.

The expert ``e`` lives on chunk ``e // E_local`` of the experts; chunk ``c``'s coordinates over the
lowering axes are ``c`` in the mixed radix of their sizes (DTensor's left-to-right nesting of
``S(0)``). The local experts recompute their GEMMs in the backward (``torch.utils.checkpoint``), so
autograd keeps the moved rows only, as the ``moe_experts`` op itself does.
"""
from __future__ import annotations

import math
import operator
from typing import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from autoshard.passes.capture.moe_experts import (capacity_rows, expert_gemms, experts_forward,
                                                   experts_forward_capacity, gather_rows, pair_slots, scatter_rows)
from autoshard.passes.graph import operand_meta, operands
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.layout.shapes import local_offsets, local_shape, normalize
from autoshard.passes.spec import Replicate, Shard, Strategy

from . import collectives as C
from .collectives import AxisComm

__all__ = ["moe_route", "exchange_routes", "all_to_all_v", "moe_gather", "moe_combine", "capacity_slots", "pair_rows",
           "capacity_experts", "combine_capacity", "local_experts", "local_experts_capacity", "emit_expert_dispatch"]


def moe_route(top_k_index: torch.Tensor, experts_local: int, radix: Sequence[int], roles: str,
              coordinate: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """(pair order, rows sent to each member of the dispatch group).

    ``radix``/``roles``/``coordinate``: per lowering axis (mesh order) its size, ``"d"`` (dispatch)
    or ``"f"`` (filter), and this rank's coordinate. Pairs (``token * k + j``) owned on another
    filter coordinate are dropped here (their owner computes them); the rest are ordered by
    destination, stably.
    """
    with torch.no_grad():
        chunk = top_k_index.reshape(-1) // experts_local
        coords = _coordinates(chunk, radix)
        keep = torch.ones_like(chunk, dtype=torch.bool)
        dest = torch.zeros_like(chunk)
        group = 1
        for coord, size, role, mine in zip(coords, radix, roles, coordinate):
            if role == "f":
                keep &= coord == mine
            else:  # row-major over the dispatch axes, as MeshEnv.comm_for numbers the group
                dest = dest * size + coord
                group *= size
        pairs = keep.nonzero().squeeze(1)
        order = pairs[torch.sort(dest[pairs], stable=True).indices]
        send = torch.bincount(dest[order], minlength=group)
    return order, send.tolist()


def _coordinates(chunk: torch.Tensor, radix: Sequence[int]) -> list[torch.Tensor]:
    """Each chunk's owner coordinate on every lowering axis (mixed radix, first axis most significant)."""
    coords, stride = [], 1
    for size in reversed(radix):
        coords.append((chunk // stride) % size)
        stride *= size
    return coords[::-1]


def exchange_routes(top_k_index: torch.Tensor, order: torch.Tensor, send: list[int],
                    comm: AxisComm) -> tuple[list[int], torch.Tensor]:
    """(rows each member sends here, their global expert ids), outside autograd."""
    n = comm.size
    with torch.no_grad():
        sent = torch.tensor(send, dtype=torch.int64, device=top_k_index.device)  # NCCL needs device tensors
        got = torch.empty(n, dtype=torch.int64, device=top_k_index.device)
        dist.all_to_all_single(got, sent, [1] * n, [1] * n, group=comm.pg())
        recv = got.tolist()
        ids = top_k_index.reshape(-1)[order].contiguous()
        expert_ids = ids.new_empty(sum(recv))
        dist.all_to_all_single(expert_ids, ids, recv, send, group=comm.pg())
    return recv, expert_ids.unsqueeze(1)


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, comm):
        ctx.splits, ctx.comm = (send, recv), comm
        return _exchange_rows(x, send, recv, comm)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.splits
        return _exchange_rows(g, recv, send, ctx.comm), None, None, None


def _exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], comm: AxisComm) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=comm.pg())
    return out


def all_to_all_v(x: torch.Tensor, send: list[int], recv: list[int], comm: AxisComm) -> torch.Tensor:
    """Uneven all-to-all of rows: ``send[r]`` rows of ``x`` (in order) to member ``r``, ``recv[r]``
    rows from it. Autograd: the backward sends the gradient rows back (split sizes swapped)."""
    if comm.size == 1:
        return x
    return _AllToAllV.apply(x, list(send), list(recv), comm)


def moe_gather(hidden: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The token row of each pair in ``order`` (pair ``p`` is token ``p // k``)."""
    return hidden[order // k]


def moe_combine(rows: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, tokens: int, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum`` over the pairs of token ``t`` in ``order`` of weight times expert row."""
    weighted = rows * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
    out = rows.new_zeros((tokens,) + tuple(rows.shape[1:]))
    return out.index_add(0, order // k, weighted).to(dtype)


def capacity_slots(top_k_index: torch.Tensor, experts_local: int, radix: Sequence[int], roles: str,
                   coordinate: Sequence[int], capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, kept) of every pair in this rank's send buffer under a capacity: bucket ``dest *
    experts_local + local expert``; pairs owned on another filter coordinate, or beyond their
    expert's ``capacity`` rows, are not kept (``pair_slots``)."""
    with torch.no_grad():
        flat = top_k_index.reshape(-1)
        chunk = flat // experts_local
        keep = torch.ones_like(chunk, dtype=torch.bool)
        dest = torch.zeros_like(chunk)
        group = 1
        for coord, size, role, mine in zip(_coordinates(chunk, radix), radix, roles, coordinate):
            if role == "f":
                keep &= coord == mine
            else:
                dest = dest * size + coord
                group *= size
        buckets = group * experts_local
        bucket = torch.where(keep, dest * experts_local + flat % experts_local, torch.full_like(flat, buckets))
    return pair_slots(bucket, buckets, capacity)


def pair_rows(hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Each pair's token row, pairs in order (pair ``p`` is token ``p // k``)."""
    return hidden.repeat_interleave(k, 0)


def combine_capacity(back: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor,
                     tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The returned expert rows, weighted and summed per token (``gather_rows``), in ``dtype``."""
    return gather_rows(back, slot, kept, weights, tokens, k).to(dtype)


def capacity_experts(rows: torch.Tensor, group: int, capacity: int, gate: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor, activation: str) -> torch.Tensor:
    """Received ``(group * E_local * capacity, H)`` rows (source-major) through the local experts,
    batched per expert; the result in the same layout, ready to go back."""
    experts_local, hidden = gate.shape[0], rows.shape[-1]
    x = rows.view(group, experts_local, capacity, hidden).transpose(0, 1)
    x = x.reshape(experts_local, group * capacity, hidden)
    y = checkpoint(expert_gemms, x, gate, up, down, activation, use_reentrant=False)  # keeps only its inputs
    return y.view(experts_local, group, capacity, -1).transpose(0, 1).reshape(group * experts_local * capacity, -1)


def local_experts(rows: torch.Tensor, expert_ids: torch.Tensor, weights, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, activation: str, first_expert: int) -> torch.Tensor:
    """``experts_forward`` on this rank's experts, recomputed in the backward (autograd keeps only
    its inputs, as the ``moe_experts`` op itself does)."""
    return checkpoint(experts_forward, rows, expert_ids, weights, gate, up, down, activation, first_expert,
                      use_reentrant=False)


def local_experts_capacity(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                           up: torch.Tensor, down: torch.Tensor, activation: str, first_expert: int,
                           capacity: int) -> torch.Tensor:
    """``experts_forward_capacity`` on this rank's experts, recomputed in the backward."""
    return checkpoint(experts_forward_capacity, hidden, index, weights, gate, up, down, activation, first_expert,
                      capacity, use_reentrant=False)


def emit_expert_dispatch(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy,
                         axes: tuple) -> fx.Node:
    """Emit one ``moe_experts`` node under ``expert_dispatch`` on ``axes`` (see the module docstring)."""
    ops = operands(node)
    if len(ops) != 6:
        raise PlanFormatError(f"node {node.name}: 'expert_dispatch' lowers autoshard::moe_experts "
                              f"(6 tensor operands), not {node.target}")
    hidden, index, weights, gate, up, down = (a for a in args[:6])
    activation = args[6] if len(args) > 6 else kwargs["activation"]
    mesh = ctx.mesh.shape
    gate_meta = operand_meta(ops[3])
    gate_pl = normalize(strategy.inputs[3], mesh)
    first = local_offsets(gate_meta.shape, gate_pl, mesh, ctx.env.coordinate)[0]
    experts_local = local_shape(gate_meta.shape, gate_pl, mesh)[0]
    roles = ""
    for a in axes:
        tok, exp = strategy.inputs[0][a], strategy.inputs[3][a]
        if not (isinstance(exp, Shard) and exp.dim == 0):
            raise PlanFormatError(f"node {node.name}: 'expert_dispatch' on mesh axis {a} needs the experts S(0)")
        roles += "d" if isinstance(tok, Shard) and tok.dim == 0 else "f" if isinstance(tok, Replicate) else "?"
    if "?" in roles:
        raise PlanFormatError(f"node {node.name}: 'expert_dispatch' needs the tokens S(0) or R on each of its axes")
    g = ctx.graph
    tokens, k = local_shape(operand_meta(ops[1]).shape, normalize(strategy.inputs[1], mesh), mesh)
    factor = args[7] if len(args) > 7 else kwargs.get("capacity_factor", 0.0)
    capacity = None
    if strategy.lowerings[axes[0]] == "expert_dispatch_capacity":
        if not factor or factor <= 0:
            raise PlanFormatError(f"node {node.name}: 'expert_dispatch_capacity' needs the op's capacity_factor > 0")
        capacity = capacity_rows(tokens * k, gate_meta.shape[0], factor)
    radix = [mesh[a] for a in axes]
    coordinate = [ctx.env.coordinate[a] for a in axes]
    dispatch_axes = tuple(a for a, r in zip(axes, roles) if r == "d")
    if "d" not in roles:
        if capacity is not None:
            return g.call_function(local_experts_capacity, (hidden, index, weights, gate, up, down, activation,
                                                            first, capacity))
        return g.call_function(local_experts, (hidden, index, weights, gate, up, down, activation, first))
    dtype = operand_meta(ops[0]).dtype
    if capacity is not None:
        slots = g.call_function(capacity_slots, (index, experts_local, radix, roles, coordinate, capacity))
        slot, kept = (g.call_function(operator.getitem, (slots, i)) for i in (0, 1))
        group = math.prod(mesh[a] for a in dispatch_axes)
        rows = g.call_function(scatter_rows, (g.call_function(pair_rows, (hidden, k)), slot, kept,
                                              group * experts_local * capacity))
        rows = ctx.collective(C.all_to_all, (rows, 0, 0), dispatch_axes)
        done = g.call_function(capacity_experts, (rows, group, capacity, gate, up, down, activation))
        back = ctx.collective(C.all_to_all, (done, 0, 0), dispatch_axes)
        return g.call_function(combine_capacity, (back, slot, kept, weights, tokens, k, dtype))
    route = g.call_function(moe_route, (index, experts_local, radix, roles, coordinate))
    order, send = (g.call_function(operator.getitem, (route, i)) for i in (0, 1))
    routes = ctx.collective(exchange_routes, (index, order, send), dispatch_axes)
    recv, expert_ids = (g.call_function(operator.getitem, (routes, i)) for i in (0, 1))
    rows = ctx.collective(all_to_all_v, (g.call_function(moe_gather, (hidden, order, k)), send, recv), dispatch_axes)
    done = g.call_function(local_experts, (rows, expert_ids, None, gate, up, down, activation, first))
    back = ctx.collective(all_to_all_v, (done, recv, send), dispatch_axes)
    return g.call_function(moe_combine, (back, order, weights, tokens, k, dtype))

