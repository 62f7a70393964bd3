"""Rank simulation: ``n`` ranks of one mesh axis in one process, for one op under one ``Strategy1D``.

A ``Strategy1D`` gives a placement per operand and per output along one mesh axis of size ``n``:

- ``split_by_placement`` cuts an operand into the ``n`` pieces the ranks hold: ``S(d)`` ->
  ``torch.chunk`` along d, ``R`` -> the same tensor on every rank, ``P`` -> random summands (drawn
  from the caller's generator) that add up to the tensor, for floating or complex tensors only
  (``inexact``). A sharded dim that does not divide by ``n`` raises ``Indivisible``
  (``check_divides`` asks the same of an output; ``piece_shape`` is one rank's shape of a tensor);
- ``run_local`` runs one rank: the ATen op on its pieces, its size argument (view, reshape, expand,
  new_*, ...) rewritten to the local output shape by the runtime's own ``local_size_args``; or the
  strategy's lowering, written out inline here ("loss_mean_partial", "embedding_vocab",
  "mean_partial"; any other raises ``AssertionError``). It takes every rank's call, since a lowering
  reads the other ranks' pieces (a loss's total count, a vocabulary shard's offset);
- ``assemble`` rebuilds a full tensor from the per-rank pieces: ``S``: cat, ``R``: every rank must
  agree (checked with the caller's ``close``), ``P``: sum. For a gradient ``R`` and ``P`` swap roles,
  by the convention of ``passes/spec.py``.

May import: torch, ``autoshard.passes``, ``autoshard.runtime`` and ``autoshard.testing.op_calls``.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.passes.graph import META
from autoshard.passes.schema import bind_args, op_name, rebuild_args
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.runtime.localize import local_size_args

__all__ = ["Indivisible", "inexact", "check_divides", "piece_shape", "split_by_placement", "run_local", "assemble"]


class Indivisible(Exception):
    pass


def inexact(t: torch.Tensor) -> bool:
    """Floating or complex: compared with a tolerance, split into random summands, differentiated."""
    return t.is_floating_point() or t.is_complex()


def check_divides(t: torch.Tensor, p: Placement, n: int) -> None:
    if isinstance(p, Shard) and t.shape[p.dim] % n:
        raise Indivisible(f"dim {p.dim} of size {t.shape[p.dim]} does not divide by {n}")


def piece_shape(t: torch.Tensor, p: Placement, n: int) -> tuple[int, ...]:
    return tuple(s // n if isinstance(p, Shard) and p.dim == d else s for d, s in enumerate(t.shape))


def split_by_placement(x: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    check_divides(x, p, n)
    if isinstance(p, Shard):
        return [c.contiguous() for c in torch.chunk(x, n, p.dim)]
    if isinstance(p, Partial):
        if not inexact(x):
            raise AssertionError(f"P placement on a {x.dtype} operand")
        parts = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
        return parts + [x - sum(parts)] if parts else [x.clone()]
    return [x.clone() for _ in range(n)]


def _with_arg(target, args, kwargs, name, value) -> tuple[tuple, dict]:
    return rebuild_args(target, {**bind_args(target, args, kwargs), name: value})


_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                 "nll_loss2d_forward"}


def _loss_count(target, args, kwargs) -> torch.Tensor:
    """How many elements (or how much class weight) a mean-reduced loss divides by, locally."""
    b = bind_args(target, args, kwargs)
    inp, tgt = b["self"], b["target"]
    if op_name(target) in _CLASS_LOSSES:
        if tgt.is_floating_point():  # class probabilities: mean over the batch elements
            return torch.tensor(inp.numel() / inp.shape[1 if inp.dim() > 1 else 0])
        mask = tgt != b.get("ignore_index", -100)
        w = b.get("weight")
        return mask.sum() if w is None else w.detach()[tgt[mask]].sum()
    return torch.tensor(math.prod(torch.broadcast_shapes(inp.shape, tgt.shape)))


def _sim_loss_mean_partial(target, calls, rank):
    total = sum(_loss_count(target, a, k) for a, k in calls)
    args, kwargs = _with_arg(target, *calls[rank], "reduction", 2)
    res = target(*args, **kwargs)
    if isinstance(res, tuple):
        return (res[0] / total, *res[1:])
    return res / total


def _sim_embedding_vocab(target, calls, rank):
    args, kwargs = calls[rank]
    b = bind_args(target, args, kwargs)
    weight, idx = b["weight"], b["indices"]
    lo = sum(bind_args(target, *calls[q])["weight"].shape[0] for q in range(rank))
    rows = weight.shape[0]
    mask = (idx >= lo) & (idx < lo + rows)
    pad = b.get("padding_idx", -1)
    local_pad = pad - lo if pad is not None and lo <= pad < lo + rows else -1
    args, kwargs = _with_arg(target, args, kwargs, "indices", torch.where(mask, idx - lo, 0))
    args, kwargs = _with_arg(target, args, kwargs, "padding_idx", local_pad)
    return target(*args, **kwargs) * mask.unsqueeze(-1).to(weight.dtype)


def _reduced_count(shape, dims) -> int:
    if dims is None or len(dims) == 0:
        return math.prod(shape)
    return math.prod(shape[d % len(shape)] for d in dims)


def _sim_mean_partial(target, calls, rank, full_shape):
    args, kwargs = calls[rank]
    b = bind_args(target, args, kwargs)
    dims = b.get("dim")
    local = _reduced_count(b["self"].shape, dims)
    return target(*args, **kwargs) * (local / _reduced_count(full_shape, dims))


def run_local(node: fx.Node, s: Strategy1D, calls, rank: int, full, n: int):
    """What rank ``rank`` computes for ``node`` under ``s``: ``calls`` holds every rank's
    ``(args, kwargs)`` with its pieces in place, ``full`` the unsharded operands."""
    op, (args, kwargs) = node.target, calls[rank]
    if s.lowering is None:
        meta = node.meta[META]
        if isinstance(meta, TensorMeta):  # as the runtime does: size arguments become local sizes
            p = s.outputs[0]
            local = [size // n if isinstance(p, Shard) and p.dim == d else size for d, size in enumerate(meta.shape)]
            args, kwargs = local_size_args(op, args, kwargs, local)
        return op(*args, **kwargs)
    if s.lowering == "loss_mean_partial":
        return _sim_loss_mean_partial(op, calls, rank)
    if s.lowering == "embedding_vocab":
        return _sim_embedding_vocab(op, calls, rank)
    if s.lowering == "mean_partial":
        return _sim_mean_partial(op, calls, rank, full[0].shape)
    raise AssertionError(f"{op}: no simulation of lowering {s.lowering!r} in autoshard/testing/rank_simulation.py")


def assemble(what: str, pieces: list[torch.Tensor], p: Placement, grad: bool, close) -> torch.Tensor:
    """Rebuild a full tensor from per-rank pieces. For gradients R and P swap roles (spec.py)."""
    kind = "S" if isinstance(p, Shard) else ("R" if isinstance(p, Replicate) else "P")
    if grad and kind != "S":
        kind = "P" if kind == "R" else "R"
    if kind == "S":
        return torch.cat(pieces, p.dim)
    if kind == "P":
        return sum(pieces[1:], pieces[0].clone())
    for r, t in enumerate(pieces[1:], 1):
        close(t, pieces[0], f"{what}: rank {r} disagrees with rank 0 on a replicated value")
    return pieces[0]
