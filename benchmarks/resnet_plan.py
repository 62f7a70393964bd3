"""Plan a ResNet-18-shaped CNN (BatchNorm in training mode) on a (2, 2) H100 mesh: time, solver status
and the memory levers chosen (with ample memory none should be).

    python benchmarks/resnet_plan.py [--batch 16] [--width 64]

The model is built here (no torchvision): a 7x7 stem, four stages of two basic blocks (the first of
stages 2-4 downsampling through a 1x1 conv + BatchNorm), global average pooling and a classifier.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + identity)


class ResNet18Like(nn.Module):
    def __init__(self, classes: int = 10, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, c in enumerate((width, 2 * width, 4 * width, 8 * width)):
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)))
            cin = c
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = ResNet18Like(width=args.width)
    x, y = torch.randn(args.batch, 3, 64, 64), torch.randint(0, 10, (args.batch,))
    t0 = time.perf_counter()
    plan = autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y,
                          hardware="h100")
    stats = plan.solution.solver_stats
    print(f"plan() {time.perf_counter() - t0:.2f} s (solver wall {stats.get('wall_s')} s), status {stats['status']}, "
          f"gap {stats.get('gap')}, levers {plan.solution.levers}")


if __name__ == "__main__":
    main()
