"""Captured training steps of the shared models on the meta device, for planner tests (nothing is allocated).

    cg = mlp_graph(64, 256, 32)              # MLP(64, 256) on a batch of 32, MSE against a (32, 64) target
    cg = mlp_graph(256, 1024, 8, out=16, loss="ce")
    cg = gpt_graph(2)                        # 2 blocks of width 64, batch 8, sequence 32, untied LM head
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.graph import CapturedGraph
from autoshard.testing.models import GPT, MLP, lm_loss

__all__ = ["mlp_graph", "gpt_graph"]


def mlp_graph(d: int, hidden: int, batch: int, *, out: int | None = None, loss: str = "mse") -> CapturedGraph:
    """An ``MLP(d, hidden, out)`` training step: MSE against a (batch, out) target, or (``loss="ce"``)
    cross-entropy against (batch,) class ids."""
    with torch.device("meta"):
        model = MLP(d, hidden, out)
    x = torch.empty(batch, d, device="meta")
    if loss == "ce":
        y = torch.empty(batch, dtype=torch.long, device="meta")
        return capture(model, (x,), loss_fn=F.cross_entropy, target=y)
    y = torch.empty(batch, out or d, device="meta")
    return capture(model, (x,), loss_fn=F.mse_loss, target=y)


def gpt_graph(layers: int, *, batch: int = 8, seq: int = 32, d: int = 64) -> CapturedGraph:
    """A ``GPT`` training step (vocabulary 128, 4 heads, fused biased qkv, untied head) on token ids."""
    with torch.device("meta"):
        model = GPT(128, d, layers, 4, seq, tied=False, fused_qkv=True)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids)
