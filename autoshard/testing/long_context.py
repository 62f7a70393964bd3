"""Models and pins for context-parallel tests: one attention layer, and the layouts that split its sequence.

``seq_attention(heads, kv_heads, causal)`` builds ``SeqAttention`` (x ``(B, L, D)`` -> q/k/v
projections -> ``scaled_dot_product_attention`` with ``enable_gqa`` when ``kv_heads < heads`` -> output
projection, plus the input as a residual) with an MSE loss against a ``(B, L, D)`` target.

``cp_pins(mesh_shape, mode, seq_axes)`` pins, on the sequence axes ``seq_axes`` (default: every axis),
the input, the target and every Linear's output sequence-split (``S(1)``) and the attention's output:
``"ring"`` -> ``S(2)`` (the sequence), which only ring attention produces; ``"ulysses"`` -> ``S(1)``
(the heads), reached from the sequence-split activations by all-to-all. The other axes split the
batch (``S(0)`` everywhere). The solver chooses everything else.

Ulysses over two axes at once is correct but not an all-to-all: the redistribution of a dim split
by two nested axes to another dim gathers and chunks (``runtime/redistribute.py``), so a Ulysses
layout belongs on one axis.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SeqAttention", "seq_attention", "cp_pins", "SDPA_NODES"]

#: fnmatch pattern of the captured attention nodes
SDPA_NODES = "scaled_dot_product_attention*"


class SeqAttention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.hd = d // heads
        self.q = nn.Linear(d, heads * self.hd, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, l, _ = x.shape
        q = self.q(x).view(b, l, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, l, 2, self.kv_heads, self.hd).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
                                           enable_gqa=self.kv_heads != self.heads)
        return x + self.o(y.transpose(1, 2).reshape(b, l, -1))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def seq_attention(heads: int = 4, kv_heads: int = 4, causal: bool = True, seq: int = 16, batch: int = 2,
                  d: int = 32):
    """``(model, (x,), target, loss_fn)`` for one attention layer."""
    model = SeqAttention(d, heads, kv_heads, causal)
    return model, (torch.randn(batch, seq, d),), torch.randn(batch, seq, d), _mse


def cp_pins(mesh_shape: tuple, mode: str, seq_axes: Optional[tuple] = None) -> dict:
    """Pins (``inputs``, ``ops``) for a ring or Ulysses layout on ``seq_axes`` of ``mesh_shape``."""
    if mode not in ("ring", "ulysses"):
        raise ValueError(f"mode must be 'ring' or 'ulysses', not {mode!r}")
    seq_axes = tuple(range(len(mesh_shape))) if seq_axes is None else tuple(seq_axes)
    on = lambda p: tuple(p if a in seq_axes else "S(0)" for a in range(len(mesh_shape)))  # noqa: E731
    out = on("S(2)" if mode == "ring" else "S(1)")
    return {"inputs": {0: on("S(1)"), "target": on("S(1)")}, "ops": {"linear*": on("S(1)"), SDPA_NODES: out}}
