"""Plan and train an MLP with autoshard.

    python examples/mlp.py                              # plan only: prints plans for several meshes
    torchrun --nproc_per_node 4 examples/mlp.py --train # train on 4 CPU ranks (gloo)
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard


class MLP(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    if not args.train:
        for mesh, hw in (((4,), "cpu"), ((2, 2), "h100"), ((8,), "h100")):
            p = autoshard.plan(model, mesh, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware=hw)
            print(p.summary(), "\n")
        big = MLP(d=4096, hidden=16384).to("meta")
        p = autoshard.plan(big, (4,), example_inputs=(torch.empty(2, 4096, device="meta"),), loss_fn=F.mse_loss,
                           example_target=torch.empty(2, 4096, device="meta"), hardware="h100")
        print("large weights, tiny batch:\n" + p.summary())
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cm = autoshard.compile(model, (world,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    for step in range(20):
        loss = cm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if int(os.environ.get("RANK", "0")) == 0 and step % 5 == 0:
            print(f"step {step} loss {loss:.4f}")


if __name__ == "__main__":
    main()
