"""Clip gradients by their global norm over a compiled program's shards.

``torch.nn.utils.clip_grad_norm_(cm.parameters(), ...)`` on a sharded program would see only this rank's
pieces: ranks would compute different norms and scale their gradients by different factors. Here every
element of every gradient is counted exactly once over the whole world: a piece counts on the rank at
coordinate 0 of each mesh axis where the gradient is replicated (``Holding.counts_gradient``: after the
gradient all-reduce, a replicated parameter's gradient is the same full sum on every rank of that axis),
and a weight held by several pipeline stages counts in its first stage only. One all-reduce (a sum of
p-th powers, or a max for the inf norm) over the world gives every rank the same total, and every local
gradient, counted or not, is scaled by the same ``min(1, max_norm / (total + 1e-6))`` that
``torch.nn.utils.clip_grad_norm_`` applies.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .holdings import Holding

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def global_grad_norm(held: list[Holding], norm_type: float = 2.0, device=None) -> torch.Tensor:
    """The norm of all gradients of ``held`` (this rank's pieces) over the world, on every rank; a
    collective when torch.distributed is initialized. Sums in float64."""
    norm_type = float(norm_type)
    grads = [h.optimized.grad for h in held if h.is_param and h.optimized.grad is not None and h.counts_gradient()]
    if device is None:
        device = next((h.tensor.device for h in held), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        for g in grads:
            if g.numel():
                total = torch.maximum(total, g.detach().abs().max().double())
        if dist.is_initialized():
            _all_reduce(total, dist.ReduceOp.MAX)
        return total
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), norm_type).double() ** norm_type
    if dist.is_initialized():
        _all_reduce(total, dist.ReduceOp.SUM)
    return total ** (1.0 / norm_type)


def _all_reduce(total: torch.Tensor, op) -> None:
    # Issued async and waited: with gloo under torch 2.13, a rank whose LAST collective was a blocking
    # one can abort at interpreter exit ("terminate called without an active exception") while its
    # peer is still finishing that collective; clipping is often a training loop's last collective.
    dist.all_reduce(total, op=op, async_op=True).wait()


def clip_grad_norm_(held: list[Holding], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every local gradient of ``held`` so the global norm is at most ``max_norm``; returns the
    global norm before clipping (a float32 scalar tensor, the same on every rank), as torch's does."""
    total = global_grad_norm(held, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {float(norm_type)} of the gradients is non-finite, so it cannot "
                           "be clipped; pass error_if_nonfinite=False to clip anyway")
    grads = [h.optimized.grad for h in held if h.is_param and h.optimized.grad is not None]
    dtype = grads[0].dtype if grads else torch.float32
    clip = torch.clamp(float(max_norm) / (total.to(dtype) + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(clip.to(g.device, g.dtype))
    return total.to(dtype)
