"""Local work timed while every rank competes for the cores: matmuls, copies, elementwise ops, op launches.

Each benchmark returns rows of ``[size..., seconds]`` for the fits of ``passes/cost/profile_format.py``:

- ``time_matmuls``: ``[m, k, n, seconds]``, the mean over the three layouts a training step
  multiplies in (forward, input gradient, weight gradient);
- ``time_copies``: ``[bytes read + written, seconds]`` of large copies;
- ``time_elementwise``: ``[bytes as the cost model counts them, seconds]`` of a GELU / layer norm /
  softmax / mul / add mix;
- ``time_op_chain``: ``[op launches as the cost model counts them, seconds]`` of forward + backward
  through a captured network of tiny ops (the per-op launch cost).

Operands cycle through sets larger than the caches, as in a step where an op's operands were
written long before it runs, and every batch ends at a barrier (``Timer(..., fence=True)``), so
ranks sharing a CPU are timed while they all compete for its cores.
"""
from __future__ import annotations

import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import PRESETS
from autoshard.profiling.timer import Timer, calls_per_batch

__all__ = ["time_matmuls", "time_copies", "time_elementwise", "time_op_chain"]

MiB = 1024 * 1024


def _rotation(bytes_per_set: float, budget: float = 32 * MiB) -> int:
    """How many operand sets to cycle through so the working set exceeds the caches, as in a
    training step where an op's operands were written long before it runs."""
    return int(max(1, min(16, budget // max(bytes_per_set, 1.0))))


def time_matmuls(timer: Timer, shapes, dtype, device) -> list:
    """[m, k, n, seconds] per shape: the mean over the three layouts a training step multiplies in
    (forward ``A B``, input gradient ``G B^T``, weight gradient ``A^T G``), operands cycled cold."""
    rows = []
    for m, k, n in shapes:
        sets = [(torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype),
                 torch.randn(n, k, device=device).to(dtype).t(), torch.randn(k, m, device=device).to(dtype).t())
                for _ in range(_rotation(4.0 * (2 * m * k + 2 * k * n)))]
        state = {"i": 0}

        def run():
            a, b, bt, at = sets[state["i"] % len(sets)]
            state["i"] += 1
            torch.mm(a, b)
            torch.mm(a, bt)
            torch.mm(at, b)
        rows.append([m, k, n, timer(run, calls_per_batch(6.0 * m * k * n, 4e9, 200), fence=True) / 3])
    return rows


def time_copies(timer: Timer, sizes, device) -> list:
    """[bytes read + written, seconds] of one ``copy_`` between two float32 tensors of half that size."""
    rows = []
    for moved in sizes:
        src = torch.empty(int(moved) // 8, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        rows.append([2 * src.numel() * 4, timer(lambda: dst.copy_(src), calls_per_batch(moved, 2e9, 200), fence=True)])
    return rows


def time_elementwise(timer: Timer, sizes, device) -> list:
    """GELU, layer norm, softmax, mul, add over ``numel`` floats, forward, operands cycled cold:
    [bytes read + written as the cost model counts them (12 * 4 * numel), seconds]."""
    rows = []
    for numel in sizes:
        xs = [torch.randn(int(numel) // 256, 256, device=device) for _ in range(_rotation(16.0 * numel))]
        state = {"i": 0}

        def run():
            x = xs[state["i"] % len(xs)]
            state["i"] += 1
            y = torch.nn.functional.gelu(x)
            z = torch.nn.functional.layer_norm(y, (256,))
            w = torch.softmax(z, -1)
            return w * x + y
        rows.append([12 * 4 * xs[0].numel(), timer(run, calls_per_batch(xs[0].numel() * 20, 1e8, 200), fence=True)])
    return rows


class _Chain(torch.nn.Module):
    """A generic mix of small ops (layer norm, linear, GELU, view/transpose, softmax, residual add),
    ``layers`` times: what an eager step dispatches per op when the tensors are tiny."""

    def __init__(self, layers: int, d: int = 8):
        super().__init__()
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.fcs = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x):
        b, t, d = x.shape
        for norm, fc in zip(self.norms, self.fcs):
            h = torch.nn.functional.gelu(fc(norm(x)))
            h = h.view(b, t, 2, d // 2).transpose(1, 2).softmax(-1).transpose(1, 2).reshape(b, t, d)
            x = x + h
        return x


def time_op_chain(timer: Timer, lengths, device) -> list:
    """Forward + backward of the captured ``_Chain`` program (as the runtime runs programs) for
    several depths; each sample is [op launches as the cost model counts them, seconds]."""
    rows = []
    for layers in lengths:
        torch.manual_seed(0)
        model = _Chain(layers)
        x, y = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
        cg = capture(model, (x,), loss_fn=torch.nn.functional.mse_loss, target=y)
        facts = GraphFacts(cg, PRESETS["cpu"])
        launches = sum(facts.launches(n) for n in facts.kind)
        gm = cg.gm.to(device)
        params = [p.detach().to(device).requires_grad_(True) for p in model.parameters()]
        args = [*params, x.to(device), y.to(device)]

        def run(gm=gm, args=args):
            gm(*args).backward()
        rows.append([launches, timer(run, calls_per_batch(launches, 4000, 200), fence=True)])
    return rows
