"""The redistribution collectives as functional collectives, so ``torch.compile`` sees them.

``collectives.py``'s calls are autograd Functions that run c10d in place: a compiler cannot trace
them. Here each one is written with ``torch.ops._c10d_functional`` (out of place, with autograd
registered by torch: all-gather <-> reduce-scatter, all-reduce <-> all-reduce, all-to-all <->
all-to-all) and ``wait_tensor``, around the same data movement (``movedim``/``contiguous``), so a
program step means the same thing, in eager mode or compiled, and the gradient convention of
``collectives.py`` holds unchanged:

===================================  ==============================================
functional call                      same as
===================================  ==============================================
all_gather(x, dim, group, size)      collectives.all_gather(x, dim, comm)
reduce_scatter(x, dim, group, size)  collectives.reduce_scatter(x, dim, comm)
all_reduce(x, group)                 collectives.all_reduce(x, comm)
all_to_all(x, g, s, group, size)     collectives.all_to_all(x, g, s, comm)
chunk(x, dim, size, rank)            collectives.chunk(x, dim, comm) (local)
to_partial(x, rank)                  collectives.to_partial(x, comm) (local)
===================================  ==============================================

``group`` is the process group's name (``ProcessGroup.group_name``): a string, so a compiled graph
holds no Python objects. ``functionalize(program)`` rewrites a lowered program's collective calls
into these (keeping ``lower.COLLECTIVE_META``); a call whose axis has no process group (a program
built offline) is left as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import collectives as C

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "to_partial", "FUNCTIONAL",
           "functionalize"]

_ops = torch.ops._c10d_functional


def _wait(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = _ops.wait_tensor(x)
    return out != 0 if dtype == torch.bool else out


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A bool tensor travels as uint8 (its sums read back as ``!= 0``): inductor (torch 2.13) hands back
    a bool tensor all-gathered or reduce-scattered as int64."""
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def all_gather(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """S(dim) -> R over the group of ``size`` ranks named ``group``."""
    src = _bytes(x.movedim(dim, 0).contiguous() if dim else x.contiguous())
    out = _wait(_ops.all_gather_into_tensor(src, size, group), x.dtype)
    return out.movedim(0, dim).contiguous() if dim else out


def reduce_scatter(x: torch.Tensor, dim: int, group: str, size: int) -> torch.Tensor:
    """P -> S(dim): the sum over the group, this rank's chunk of ``dim``."""
    src = _bytes(x.movedim(dim, 0).contiguous() if dim else x.contiguous())
    out = _wait(_ops.reduce_scatter_tensor(src, "sum", size, group), x.dtype)
    return out.movedim(0, dim).contiguous() if dim else out


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """P -> R: the sum over the group (a new tensor)."""
    return _wait(_ops.all_reduce(_bytes(x.contiguous()), "sum", group), x.dtype)


def all_to_all(x: torch.Tensor, gather_dim: int, scatter_dim: int, group: str, size: int) -> torch.Tensor:
    """S(gather_dim) -> S(scatter_dim) in one exchange."""
    pieces = x.unflatten(scatter_dim, (size, x.shape[scatter_dim] // size)).movedim(scatter_dim, 0).contiguous()
    out = _wait(_ops.all_to_all_single(_bytes(pieces), [1] * size, [1] * size, group), x.dtype)
    # out[k] is rank k's piece of gather_dim: put the rank index right before gather_dim and merge.
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1).contiguous()


def chunk(x: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """R -> S(dim): this rank's chunk (a contiguous copy, as ``collectives.chunk`` hands on)."""
    m = x.shape[dim] // size
    return x.narrow(dim, rank * m, m).contiguous()


def to_partial(x: torch.Tensor, rank: int) -> torch.Tensor:
    """R -> P: coordinate 0 keeps the value, the others hold zeros (their gradient is zero too)."""
    if rank == 0:
        return x
    return torch.where(torch.zeros((), dtype=torch.bool, device=x.device), x, x.new_zeros(()))


#: eager collective -> (functional call, how its comm argument becomes static arguments)
FUNCTIONAL = {
    C.all_gather: (all_gather, lambda comm: (comm.pg().group_name, comm.size)),
    C.reduce_scatter: (reduce_scatter, lambda comm: (comm.pg().group_name, comm.size)),
    C.all_reduce: (all_reduce, lambda comm: (comm.pg().group_name,)),
    C.all_to_all: (all_to_all, lambda comm: (comm.pg().group_name, comm.size)),
    C.chunk: (chunk, lambda comm: (comm.size, comm.rank)),
    C.to_partial: (to_partial, lambda comm: (comm.rank,)),
}


def _comm_of(node, program: fx.GraphModule):
    if isinstance(node, C.AxisComm):
        return node
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = getattr(program, node.target, None)
        if isinstance(value, C.AxisComm):
            return value
    return None


def functionalize(program: fx.GraphModule) -> fx.GraphModule:
    """``program`` (a flat lowered program, changed in place and returned) with every redistribution
    collective whose comm has a process group called in its functional form: the comm argument (a
    ``get_attr`` of an ``AxisComm``) becomes the group's name, size and this rank's index. A collective
    over one rank (the identity) is dropped, and so are comm get_attrs left unused. Other calls stay."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in FUNCTIONAL:
            continue
        comm = _comm_of(node.args[-1], program)
        if comm is None or comm.group is None:
            continue
        if comm.size == 1:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        fn, static = FUNCTIONAL[node.target]
        node.target = fn
        node.args = tuple(node.args[:-1]) + static(comm)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users and _comm_of(node, program) is not None:
            graph.erase_node(node)
    graph.lint()
    program.recompile()
    return program
