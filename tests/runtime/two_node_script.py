"""Run by ``test_two_nodes.py`` under two torchrun agents (two "nodes" on loopback): train the test GPT on a
(2, 2) mesh next to a single-device copy and write what this rank saw to ``<out>/rank<r>.json``."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

import autoshard
from autoshard.testing.models import gpt


def main(out: str) -> None:
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt()
    ref = copy.deepcopy(model)
    cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                           hardware="cpu")
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for _ in range(3):
        got = cm.step(*inputs, target=target)
        want = loss_fn(ref(*inputs), target)
        want.backward()
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
        losses.append((got, want.item()))
    full = cm.full_state_dict()
    worst = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                   "coordinate": list(cm.env.coordinate), "losses": losses, "worst_param_error": worst}, f)


if __name__ == "__main__":
    main(sys.argv[1])
