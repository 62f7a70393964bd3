"""The two differentiable pieces of a batch norm whose statistics span ranks (``batch_norm_sync``).

    local = bn_local_stats(x, running_mean)          # per channel: sum(x - K), sum((x - K)^2)
    stats = all_reduce(local)                        # the lowering's collective (differentiable)
    y = bn_apply(x, stats, weight, bias, running_mean, running_var, momentum, eps, global_count)

Each piece is an autograd Function that keeps only ``x`` (the same storage for both) and
per-channel vectors for the backward, as ``aten.batch_norm`` keeps its input and statistics, and
recomputes ``x - K`` and the normalized input there: written as plain tensor ops, autograd would keep
three input-sized intermediates instead of one (the cost model prices what ``aten.batch_norm``
keeps, so the runtime keeps the same). ``K`` (the running mean, detached) is a constant shift for
accuracy. The gradient reaches ``x`` directly and through the statistics, whose all-reduce carries
it across ranks.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["bn_local_stats", "bn_apply"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _chan(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, x.shape[1]] + [1] * (x.dim() - 2))


class _LocalStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shift: Optional[torch.Tensor]) -> torch.Tensor:
        xc = x - _chan(shift, x) if shift is not None else x
        dims = _reduce_dims(x)
        ctx.save_for_backward(x, shift)
        ctx.has_shift = shift is not None
        return torch.cat([xc.sum(dims), (xc * xc).sum(dims)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, shift = ctx.saved_tensors
        c = x.shape[1]
        xc = x - _chan(shift, x) if ctx.has_shift else x
        return _chan(grad[:c], x) + 2 * xc * _chan(grad[c:], x), None


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mean, invstd, weight, bias):
        y = (x - _chan(mean, x)) * _chan(invstd, x)
        if weight is not None:
            y = y * _chan(weight, x)
        if bias is not None:
            y = y + _chan(bias, x)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        x, mean, invstd, weight = ctx.saved_tensors
        dims = _reduce_dims(x)
        centered = x - _chan(mean, x)
        gxhat = gy * _chan(weight, x) if weight is not None else gy
        dweight = (gy * centered * _chan(invstd, x)).sum(dims) if weight is not None else None
        dbias = gy.sum(dims) if ctx.has_bias else None
        dx = gxhat * _chan(invstd, x)
        dmean = -dx.sum(dims)
        dinvstd = (gxhat * centered).sum(dims)
        return dx, dmean, dinvstd, dweight, dbias


def _shift(x: torch.Tensor, running_mean: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if running_mean is None else running_mean.detach().to(x.dtype).clone()


def bn_local_stats(x: torch.Tensor, running_mean: Optional[torch.Tensor]) -> torch.Tensor:
    """``cat([sum(x - K), sum((x - K)^2)])`` per channel over every dim but 1 (K: the running mean)."""
    return _LocalStats.apply(x, _shift(x, running_mean))


def bn_apply(x: torch.Tensor, stats: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float,
             eps: float, count: int) -> torch.Tensor:
    """Normalize with the global statistics (``stats`` all-reduced, ``count`` elements per channel in
    the global batch) and update the running stats in place."""
    c = x.shape[1]
    shift = _shift(x, running_mean)
    m1 = stats[:c] / count
    var = stats[c:] / count - m1 * m1
    mean = m1 + shift if shift is not None else m1
    y = _Normalize.apply(x, mean, torch.rsqrt(var + eps), weight, bias)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y
