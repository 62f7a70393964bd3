"""Autograd-aware collectives along one mesh axis (or a group of axes).

Each function is the forward of an autograd Function whose backward is its adjoint under the
gradient convention of ``passes/spec.py`` (the local gradient of ``R`` is a summand, of ``P`` the
full gradient, of ``S(d)`` the shard):

=================  =============================  ==============================
function           forward                        backward
=================  =============================  ==============================
all_gather         S(d) -> R                      reduce-scatter on d
reduce_scatter     P -> S(d)                      all-gather on d
all_reduce         P -> R                         all-reduce
all_to_all         S(i) -> S(j)                   all-to-all S(j) -> S(i)
chunk              R -> S(d) (local)              zero-pad (local)
to_partial         R -> P (zeros off coord 0)     the same (local)
=================  =============================  ==============================

They take an ``AxisComm`` last, so the per-rank fx program can print them as plain calls
(``all_gather(linear, 0, comm_tp)``). On an axis of size 1 every function is the identity. Results
are contiguous (a chunk along dim 0 of a contiguous tensor is a view, which already is), so views
the program takes later work as they did on the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from autoshard.runtime.collective_watch import note

__all__ = ["AxisComm", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "to_partial",
           "COLLECTIVES", "raw_step", "raw_adjoint", "start_flat_gather", "start_flat_reduce_scatter",
           "flat_reduce_scatter"]

# torch 2.13 renamed the tensor forms; keep working on older releases too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class AxisComm:
    """One rank's view of a mesh axis (or several axes flattened): its process group, the group's
    size and this rank's index in it. ``group`` is None when the program is built offline."""
    name: str
    size: int
    rank: int
    group: Optional[Any] = None

    def __repr__(self) -> str:
        return f"AxisComm({self.name!r}, size={self.size}, rank={self.rank})"

    def pg(self):
        if self.group is None:
            raise RuntimeError(
                f"mesh axis {self.name!r} has no process group: the program was built offline "
                "(MeshGroups.offline); build it from init_mesh_groups to run collectives"
            )
        return self.group


# ---- raw communication (no autograd) -------------------------------------------------------

def _gather(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    n = comm.size
    src = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = src.new_empty((n * src.shape[0],) + tuple(src.shape[1:]))
    note("all_gather", comm)
    _all_gather_single(out, src, group=comm.pg())
    return out.movedim(0, dim).contiguous() if dim else out


def _scatter_sum(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    n = comm.size
    src = x.movedim(dim, 0).contiguous() if dim else x.contiguous()
    out = src.new_empty((src.shape[0] // n,) + tuple(src.shape[1:]))
    note("reduce_scatter", comm)
    _reduce_scatter_single(out, src, group=comm.pg())
    return out.movedim(0, dim).contiguous() if dim else out


def _sum(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    out = x.contiguous().clone()
    note("all_reduce", comm)
    dist.all_reduce(out, group=comm.pg())
    return out


def _exchange(x: torch.Tensor, gather_dim: int, scatter_dim: int, comm: AxisComm) -> torch.Tensor:
    n = comm.size
    pieces = x.unflatten(scatter_dim, (n, x.shape[scatter_dim] // n)).movedim(scatter_dim, 0).contiguous()
    out = torch.empty_like(pieces)
    note("all_to_all", comm)
    dist.all_to_all_single(out, pieces, group=comm.pg())
    # out[k] is rank k's piece of gather_dim: put the rank index right before gather_dim and merge.
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1).contiguous()


def _take(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    m = x.shape[dim] // comm.size
    piece = x.narrow(dim, comm.rank * m, m)
    # Later views of the piece must work as they did on the whole tensor, whose strides may allow a
    # view that the narrowed piece's strides do not: always hand on a contiguous copy.
    return piece.contiguous()


def _pad(g: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    shape = list(g.shape)
    m = shape[dim]
    shape[dim] = m * comm.size
    out = g.new_zeros(shape)
    out.narrow(dim, comm.rank * m, m).copy_(g)
    return out


def _first(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return x if comm.rank == 0 else torch.zeros_like(x)


# ---- autograd Functions --------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _gather(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _scatter_sum(g, ctx.dim, ctx.comm), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _scatter_sum(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.dim, ctx.comm), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _sum(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _sum(g, ctx.comm), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_dim, scatter_dim, comm):
        ctx.dims, ctx.comm = (gather_dim, scatter_dim), comm
        return _exchange(x, gather_dim, scatter_dim, comm)

    @staticmethod
    def backward(ctx, g):
        gather_dim, scatter_dim = ctx.dims
        return _exchange(g, scatter_dim, gather_dim, ctx.comm), None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm):
        ctx.dim, ctx.comm = dim, comm
        return _take(x, dim, comm)

    @staticmethod
    def backward(ctx, g):
        return _pad(g, ctx.dim, ctx.comm), None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _first(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _first(g, ctx.comm), None


# ---- the public calls (what the per-rank program prints) -----------------------------------

def _check_dim(x: torch.Tensor, dim: int, comm: AxisComm, what: str) -> None:
    if x.shape[dim] % comm.size:
        raise RuntimeError(
            f"{what}: dim {dim} of size {x.shape[dim]} does not split over axis {comm.name!r} of size {comm.size}"
        )


def all_gather(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    """S(dim) -> R: concatenate every rank's piece along ``dim``."""
    if comm.size == 1:
        return x
    return _AllGather.apply(x, dim, comm)


def reduce_scatter(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    """P -> S(dim): sum over the axis, keep this rank's chunk of ``dim``."""
    if comm.size == 1:
        return x
    _check_dim(x, dim, comm, "reduce_scatter")
    return _ReduceScatter.apply(x, dim, comm)


def all_reduce(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """P -> R: sum over the axis (a new tensor)."""
    if comm.size == 1:
        return x
    return _AllReduce.apply(x, comm)


def all_to_all(x: torch.Tensor, gather_dim: int, scatter_dim: int, comm: AxisComm) -> torch.Tensor:
    """S(gather_dim) -> S(scatter_dim) in one exchange."""
    if comm.size == 1:
        return x
    _check_dim(x, scatter_dim, comm, "all_to_all")
    return _AllToAll.apply(x, gather_dim, scatter_dim, comm)


def chunk(x: torch.Tensor, dim: int, comm: AxisComm) -> torch.Tensor:
    """R -> S(dim): this rank's chunk, no communication."""
    if comm.size == 1:
        return x
    _check_dim(x, dim, comm, "chunk")
    return _Chunk.apply(x, dim, comm)


def to_partial(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """R -> P: coordinate 0 keeps the value, the others hold zeros."""
    if comm.size == 1:
        return x
    return _ToPartial.apply(x, comm)


#: The redistribution calls a per-rank program may contain, by name.
COLLECTIVES = {f.__name__: f for f in (all_gather, reduce_scatter, all_reduce, all_to_all, chunk, to_partial)}


# ---- the same steps outside autograd (for fused parameter gathers, ``param_gather``) ----------

def raw_step(x: torch.Tensor, kind: str, static: tuple, comm: AxisComm) -> torch.Tensor:
    """The forward of one redistribution step (a name in ``COLLECTIVES`` with its static arguments,
    as ``redistribute.step_call`` gives them), without autograd. Identity on an axis of size 1."""
    if comm.size == 1:
        return x
    if kind == "all_gather":
        return _gather(x, static[0], comm)
    if kind == "reduce_scatter":
        return _scatter_sum(x, static[0], comm)
    if kind == "all_reduce":
        return _sum(x, comm)
    if kind == "all_to_all":
        return _exchange(x, static[0], static[1], comm)
    if kind == "chunk":
        return _take(x, static[0], comm)
    if kind == "to_partial":
        return _first(x, comm)
    raise ValueError(f"unknown collective {kind!r}; known: {sorted(COLLECTIVES)}")


def raw_adjoint(g: torch.Tensor, kind: str, static: tuple, comm: AxisComm) -> torch.Tensor:
    """The backward of ``raw_step`` (the table in the module docstring), without autograd."""
    if comm.size == 1:
        return g
    if kind == "all_gather":
        return _scatter_sum(g, static[0], comm)
    if kind == "reduce_scatter":
        return _gather(g, static[0], comm)
    if kind == "all_reduce":
        return _sum(g, comm)
    if kind == "all_to_all":
        return _exchange(g, static[1], static[0], comm)
    if kind == "chunk":
        return _pad(g, static[0], comm)
    if kind == "to_partial":
        return _first(g, comm)
    raise ValueError(f"unknown collective {kind!r}; known: {sorted(COLLECTIVES)}")


def start_flat_gather(flat: torch.Tensor, comm: AxisComm) -> tuple[torch.Tensor, Any]:
    """Start gathering a 1-d tensor from every rank of ``comm``: (output of ``comm.size * len(flat)``
    elements, rank order; the async work to ``wait()`` before reading it)."""
    out = flat.new_empty((comm.size * flat.numel(),))
    note("all_gather (flat parameters)", comm)
    work = _all_gather_single(out, flat, group=comm.pg(), async_op=True)
    return out, work


def start_flat_reduce_scatter(flat: torch.Tensor, comm: AxisComm, *, consume: bool = False
                              ) -> tuple[torch.Tensor, Any]:
    """Start summing a 1-d tensor over ``comm``, keeping this rank's ``1 / comm.size`` chunk (rank
    order): (the chunk's output, the async work to ``wait()`` before reading it).

    ``consume``: the caller discards ``flat`` afterwards, so it may be overwritten. On gloo, whose
    reduce-scatter copies its whole input, all-reduces the copy and copies this rank's chunk out, the
    all-reduce then runs on ``flat`` itself and the output is a view of its chunk (the same sum,
    bitwise, without the input's copy): clone it to let ``flat`` go."""
    if consume and flat.is_contiguous() and dist.get_backend(comm.pg()) == "gloo":
        work = dist.all_reduce(flat, group=comm.pg(), async_op=True)
        return flat.view(comm.size, -1)[comm.rank], work
    out = flat.new_empty((flat.numel() // comm.size,))
    work = _reduce_scatter_single(out, flat.contiguous(), group=comm.pg(), async_op=True)
    return out, work


def flat_reduce_scatter(flat: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Sum a 1-d tensor over ``comm`` and keep this rank's ``1 / comm.size`` chunk (rank order)."""
    out = flat.new_empty((flat.numel() // comm.size,))
    note("reduce_scatter (flat gradients)", comm)
    _reduce_scatter_single(out, flat.contiguous(), group=comm.pg())
    return out
