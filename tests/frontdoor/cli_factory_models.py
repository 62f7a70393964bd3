"""A ``package.module:factory`` for the ``autoshard plan`` tests: an MLP and one global batch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Wide(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def mlp_factory(batch: int = 8):
    """(model, example_inputs, loss_fn, example_target) on the meta device."""
    with torch.device("meta"):
        model = Wide()
    x = torch.empty(batch, 32, device="meta")
    return model, (x,), F.mse_loss, torch.empty(batch, 32, device="meta")


def gpt_factory(batch: int = 8, seq: int = 16):
    """A 4-block GPT (``autoshard.testing.models.GPT``) on token ids given as a tuple: pipelines cut it."""
    from autoshard.testing.models import GPT, lm_loss
    with torch.device("meta"):
        model = GPT(64, 32, 4, 4, seq, True)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), lm_loss, ids
