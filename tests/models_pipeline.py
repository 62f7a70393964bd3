"""Test models for pipeline parallelism: a U-Net-like MLP with long skip connections, and the GPT.

Each builder returns ``(model, example_inputs, target, loss_fn, stage_prefixes)`` where
``stage_prefixes[n]`` lists the module-name prefixes where stages 1..n-1 start for ``n`` stages (2, 4, 8;
8 cuts the GPT's blocks between attention and MLP)
(see ``runtime/pipeline/split.stage_nodes_from_prefixes``). Global batch 8; the caller seeds the RNG.

``unet``: a down path of four Linear+GELU blocks and an up path of four; up block k reads the
previous up output concatenated (``up.0``, ``up.2``) or added (``up.1``, ``up.3``) with the output
of down block 3-k, so with 4 stages stage 0's ``down.0`` output travels straight to stage 3.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import BATCH, gpt

__all__ = ["UNet", "unet", "gpt_pipeline", "BUILDERS"]


class UNet(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.down = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(2 * d if k % 2 == 0 else d, d) for k in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        skips = []
        for block in self.down:
            h = F.gelu(block(h))
            skips.append(h)
        u = h
        for k, block in enumerate(self.up):
            s = skips[len(skips) - 1 - k]
            u = F.gelu(block(torch.cat([u, s], dim=-1) if k % 2 == 0 else u + s))
        return self.head(u)


def unet(d: int = 16):
    model = UNet(d)
    x = torch.randn(BATCH, d)
    prefixes = {2: ["up.0"], 4: ["down.2", "up.0", "up.2"],
                8: ["down.0", "down.2", "down.3", "up.0", "up.1", "up.2", "up.3"]}
    return model, (x,), torch.randn(BATCH, d), F.mse_loss, prefixes


def gpt_pipeline(n_layer: int = 4):
    """tests/models.py's GPT with tied embeddings (wte on stage 0, the tied LM head on the last)."""
    model, inputs, target, loss_fn = gpt(n_layer=n_layer, d=16, n_head=2, seq=8)
    prefixes = {2: [f"blocks.{n_layer // 2}"], 4: [f"blocks.{k}" for k in range(1, n_layer)],
                8: [p for k in range(n_layer) for p in ([f"blocks.{k}"] if k else []) + [f"blocks.{k}.ln2"]]}
    return model, inputs, target, loss_fn, prefixes


BUILDERS = {"unet": unet, "gpt": gpt_pipeline}
