"""Step time of autoshard's programs against torch's own, measured side by side in one run.

    torchrun --nproc_per_node 4 benchmarks/step_time.py

Two comparisons on 4 gloo ranks (CPU), each interleaved round by round so machine noise hits both:
  1. data parallel: autoshard with the DP layout pinned vs torch DistributedDataParallel;
  2. tensor parallel: autoshard with Megatron column/row pins vs DTensor ``parallelize_module`` with
     ColwiseParallel / RowwiseParallel on the same Linears.
A step is forward + backward + AdamW step on the same global batch. Prints medians and the ratio
autoshard / torch (below 1.0 means autoshard is faster).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import ResidualMLP


def timed(step_fn, iters: int) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        step_fn()
    dist.barrier()
    return (time.perf_counter() - t) / iters


def compare(name: str, ours, theirs, rounds: int, iters: int) -> tuple:
    ours(); theirs()  # warm-up
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(ours, iters))
        b.append(timed(theirs, iters))
    ma, mb = statistics.median(a), statistics.median(b)
    return name, ma, mb, ma / mb


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    d, hidden, layers, batch = int(os.environ.get("BENCH_D", 256)), int(os.environ.get("BENCH_H", 1024)), 2, 64
    rounds, iters = int(os.environ.get("BENCH_ROUNDS", 5)), int(os.environ.get("BENCH_ITERS", 5))
    torch.manual_seed(0)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    results = []

    # ---- data parallel ------------------------------------------------------------------------
    model = ResidualMLP(d, hidden, layers)
    ref = ResidualMLP(d, hidden, layers)
    ref.load_state_dict(model.state_dict())
    cm = autoshard.compile(model, (world,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                           **autoshard.presets.data_parallel((world,)))
    opt_a = torch.optim.AdamW(cm.parameters(), lr=1e-3)
    ddp = nn.parallel.DistributedDataParallel(ref)
    opt_b = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]

    def ours_dp():
        cm.step(x, target=y); opt_a.step(); opt_a.zero_grad(set_to_none=True)

    def ddp_step():
        F.mse_loss(ddp(xs), ys).backward(); opt_b.step(); opt_b.zero_grad(set_to_none=True)

    results.append(compare("data parallel vs DDP", ours_dp, ddp_step, rounds, iters))

    # ---- tensor parallel ------------------------------------------------------------------------
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = ResidualMLP(d, hidden, layers)
    ref = ResidualMLP(d, hidden, layers)
    ref.load_state_dict(model.state_dict())
    ups = [f"ups.{i}" for i in range(layers)]
    downs = [f"downs.{i}" for i in range(layers)]
    cm_tp = autoshard.compile(model, (world,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                              **autoshard.presets.megatron_mlp(model, ups, downs, (world,)))
    opt_c = torch.optim.AdamW(cm_tp.parameters(), lr=1e-3)
    mesh = init_device_mesh("cpu", (world,))
    plan = {u: ColwiseParallel() for u in ups} | {dn: RowwiseParallel() for dn in downs}
    tp = parallelize_module(ref, mesh, plan)
    opt_d = torch.optim.AdamW(tp.parameters(), lr=1e-3)

    def ours_tp():
        cm_tp.step(x, target=y); opt_c.step(); opt_c.zero_grad(set_to_none=True)

    def dtensor_step():
        F.mse_loss(tp(x), y).backward(); opt_d.step(); opt_d.zero_grad(set_to_none=True)

    results.append(compare("tensor parallel vs DTensor parallelize_module", ours_tp, dtensor_step, rounds, iters))

    if rank == 0:
        print(f"MLP d={d} hidden={hidden} layers={layers} global batch={batch}, {world} gloo ranks, "
              f"{rounds} rounds x {iters} steps, medians")
        for name, ma, mb, ratio in results:
            print(f"  {name:48s} autoshard {ma * 1e3:8.2f} ms  torch {mb * 1e3:8.2f} ms  ratio {ratio:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
