"""Models whose code a trace cannot see into, for the tests of ``passes.capture.opaque``.

    model, inputs, target, loss_fn = ste_mlp()     # a straight-through quantiser (custom autograd.Function)
    model, inputs, target, loss_fn = ctc_model()   # per-frame logits trained with F.ctc_loss

``StraightThrough`` rounds to a grid in forward and passes the gradient through unchanged in backward
(the fake-quant pattern of quantisation-aware training): traced, its forward's ``round`` has a zero
gradient, so only running the Function's own backward trains the layers before it. ``ctc_loss``'s
workspace has a size that depends on the target lengths, so no tracer can capture it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.models import BATCH

__all__ = ["StraightThrough", "QuantMLP", "ste_mlp", "FrameClassifier", "ctc_loss_of_logits", "ctc_model"]


class StraightThrough(torch.autograd.Function):
    """``round(x / step) * step`` forward; the identity backward (``step`` gets no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, step: float) -> torch.Tensor:
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class QuantMLP(nn.Module):
    """Three linears; the activations after the first two are fake-quantised."""

    def __init__(self, d: int = 16, hidden: int = 32, out: int = 4, step: float = 0.1):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, out)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThrough.apply(F.relu(self.fc1(x)), self.step)
        h = StraightThrough.apply(F.relu(self.fc2(h)), self.step)
        return self.fc3(h)


def ste_mlp(d: int = 16):
    """``QuantMLP`` on a (BATCH, d) input, MSE against a random target."""
    return QuantMLP(d), (torch.randn(BATCH, d),), torch.randn(BATCH, 4), F.mse_loss


class FrameClassifier(nn.Module):
    """(B, T, d) frames -> (B, T, classes) logits: a linear, a GELU, a linear."""

    def __init__(self, d: int = 8, hidden: int = 16, classes: int = 6):
        super().__init__()
        self.inp, self.out = nn.Linear(d, hidden), nn.Linear(hidden, classes)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.inp(frames)))


def ctc_loss_of_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CTC over (B, T, C) logits against (B, L) labels padded with -100 (blank = 0), as speech models train."""
    log_probs = logits.log_softmax(-1).transpose(0, 1)
    kept = labels >= 0
    lengths = torch.full((labels.shape[0],), log_probs.shape[0], dtype=torch.long, device=labels.device)
    return F.ctc_loss(log_probs, labels.masked_fill(~kept, 0), lengths, kept.sum(-1), blank=0, zero_infinity=True)


def ctc_model(frames: int = 12, d: int = 8, classes: int = 6):
    """``FrameClassifier`` on (BATCH, frames, d), CTC against labels of 2 to 4 classes (padded with -100)."""
    labels = torch.randint(1, classes, (BATCH, 4))
    labels[::2, 2:] = -100
    return FrameClassifier(d, 16, classes), (torch.randn(BATCH, frames, d),), labels, ctc_loss_of_logits
