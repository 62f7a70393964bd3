"""``torch.library`` custom ops and a model that calls them, for the tests of ``autoshard.register_sharding``.

    torch.ops.autoshard_testing.swiglu(gate, up)        # silu(gate) * up, fused: one node in a capture
    torch.ops.autoshard_testing.row_scale(x)            # x / (1 + |x|.sum(-1, keepdim)): rows, no rule given
    model, inputs, target, loss_fn = swiglu_mlp()       # w2(swiglu(w1 x, w3 x)), then row_scale

Both ops have a fake (meta) implementation, so ``torch.export`` keeps each as a single node, and an
autograd formula, so programs using them train. Importing this module registers them (once per
process); it registers no sharding rule: that is the user's part, which the tests play.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.models import BATCH

__all__ = ["swiglu", "row_scale", "SwiGLUMLP", "swiglu_mlp"]


@torch.library.custom_op("autoshard_testing::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@swiglu.register_fake
def _swiglu_fake(gate, up):
    return torch.empty_like(gate)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    s = torch.sigmoid(gate)
    return grad * up * s * (1 + gate * (1 - s)), grad * gate * s


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@torch.library.custom_op("autoshard_testing::row_scale", mutates_args=())
def row_scale(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs().sum(-1, keepdim=True))


@row_scale.register_fake
def _row_scale_fake(x):
    return torch.empty_like(x)


def _row_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _row_scale_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        y = x / (1 + x.abs().sum(-1, keepdim=True))
        (g,) = torch.autograd.grad(y, x, grad)
    return g


row_scale.register_autograd(_row_scale_backward, setup_context=_row_scale_setup)


class SwiGLUMLP(nn.Module):
    """``row_scale(w2(swiglu(w1(x), w3(x))))``: a SwiGLU MLP whose gate is a fused custom op."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.autoshard_testing.row_scale(self.w2(torch.ops.autoshard_testing.swiglu(self.w1(x), self.w3(x))))


def swiglu_mlp(d: int = 16, hidden: int = 32):
    """``SwiGLUMLP`` on a (BATCH, 4, d) input, MSE against a random target."""
    return SwiGLUMLP(d, hidden), (torch.randn(BATCH, 4, d),), torch.randn(BATCH, 4, d), F.mse_loss
