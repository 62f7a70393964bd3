"""Context parallelism measured on gloo ranks: what attention keeps for backward, and step time.

    torchrun --nproc_per_node 4 benchmarks/long_context_measured.py [--seq 4096] [--rounds 3]

One causal attention layer (``autoshard.testing.long_context.SeqAttention``: width 256, 8 heads,
batch 1) with its activations sequence-split on 4 ranks, compiled four ways: ring attention
(zig-zag) with its blocks through the fused kernel, the same ring with its blocks on the matmul path
(``ring_blocks.USE_FUSED = False`` while it runs), Ulysses (all-to-all to head-split attention),
and the attention gathered (sdpa pinned ``R``: every rank attends the whole sequence). Per layout:
what autograd keeps at the end of the forward on the largest rank (``CompiledModel.memory_probe``,
measured) next to the planner's activation estimate, and the median step time over interleaved
rounds (measured side by side in one run; the box is shared, so only the ratios mean something).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import ring_blocks
from autoshard.passes.units import human_bytes
from autoshard.testing.long_context import SDPA_NODES, cp_pins, seq_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = (world,)
    gathered = cp_pins(mesh, "ring")
    gathered["ops"] = {**gathered["ops"], SDPA_NODES: ("R",)}
    matmul = "ring (zig-zag), matmul blocks"
    layouts = {"ring (zig-zag), fused blocks": cp_pins(mesh, "ring"), matmul: cp_pins(mesh, "ring"),
               "ulysses": cp_pins(mesh, "ulysses"), "gathered": gathered}
    built = {}
    for label, pins in layouts.items():
        ring_blocks.USE_FUSED = label != matmul
        torch.manual_seed(0)
        model, inputs, target, loss_fn = seq_attention(8, 8, True, seq=args.seq, batch=1, d=256)
        cm = autoshard.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", **pins)
        with cm.memory_probe() as probe:
            loss = cm.step(*inputs, target=target)
        saved = torch.tensor([float(probe.saved_bytes)])
        dist.all_reduce(saved, op=dist.ReduceOp.MAX)
        built[label] = (cm, inputs, target, saved.item(), cm.plan.solution.memory_breakdown["activations"], loss)
    times = {label: [] for label in built}
    for _ in range(args.rounds):
        for label, (cm, inputs, target, *_rest) in built.items():
            ring_blocks.USE_FUSED = label != matmul
            dist.barrier()
            t = time.perf_counter()
            cm.step(*inputs, target=target)
            dist.barrier()
            times[label].append(time.perf_counter() - t)
    if rank == 0:
        base = statistics.median(times["gathered"])
        print(f"causal attention layer, batch 1 x {args.seq}, width 256, 8 heads, {world} gloo ranks, "
              f"{args.rounds} interleaved rounds")
        print("| layout | kept for backward (measured, largest rank) | estimated activations | step | vs gathered "
              "| loss |")
        print("|---|---|---|---|---|---|")
        for label, (_cm, _i, _t, saved, est, loss) in built.items():
            step = statistics.median(times[label])
            print(f"| {label} | {human_bytes(saved)} | {human_bytes(est)} | {1e3 * step:.1f} ms | {step / base:.2f}x "
                  f"| {loss:.6f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
