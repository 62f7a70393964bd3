"""Automatic 3D parallelism for GPT-3 175B on 128 nodes x 8 H100: plan time and the chosen layout,
next to Megatron-LM's published configuration (Narayanan et al. 2021, Table 1: 175B on 1024 GPUs,
tensor parallel 8, pipeline 16, global batch 1536; PP 8 appears in their other 175B runs).

    python benchmarks/plan_3d.py [--trace-blocks 2] [--mesh 128,8] [--batch 1536]

The model is Hugging Face's GPT2LMHeadModel with GPT-3 175B's shape (96 blocks, width 12288, 96
heads, sequence 2048, vocabulary 51200) on the meta device. Tracing 96 blocks of that width takes
minutes, so the benchmark traces ``--trace-blocks`` blocks: identical blocks share their costs, the
intra-op ILP counts each traced block 96 / traced times, and the layer count enters only the stage
ILP (``profile_candidates(blocks=96)``). pp = 1 (no pipeline) is not searched here: it would need
the fully traced program. Megatron's layout is scored by the same cost model and simulator.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from autoshard.passes.capture import capture
from autoshard.passes.hardware import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.planner import profile_candidates, search_stages


def gpt3(blocks: int, d: int, heads: int, seq: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=blocks, n_embd=d, n_head=heads, n_positions=seq, vocab_size=vocab, attn_pdrop=0,
                     resid_pdrop=0, embd_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg).to(torch.bfloat16)


def loss_fn(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace-blocks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--mesh", default="128,8")
    ap.add_argument("--batch", type=int, default=1536)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    mesh = Mesh(tuple(int(s) for s in args.mesh.split(",")))
    hw = get_hardware("h100")
    t0 = time.perf_counter()
    model = gpt3(args.trace_blocks, 12288, 96, args.seq, 51200)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=loss_fn, target=ids.clone())
    t1 = time.perf_counter()
    pps = [p for p in range(2, mesh.shape[0] + 1) if mesh.shape[0] % p == 0 and p <= args.blocks + 2]
    profiles = profile_candidates(captured, mesh, pps, hardware=hw, optimizer="adamw", memory_limit=hw.memory_bytes,
                                  blocks=args.blocks, time_limit_s=10)
    t2 = time.perf_counter()
    best, stats = search_stages(profiles, mesh, hardware=hw, memory_limit=hw.memory_bytes, batch=args.batch)
    t3 = time.perf_counter()
    print(f"GPT-3 175B shape: {args.blocks} blocks (traced {args.trace_blocks}), d 12288, seq {args.seq}, "
          f"global batch {args.batch}, mesh {mesh.shape}, h100")
    print(f"  trace {t1 - t0:7.2f} s   ({len(captured.gm.graph.nodes)} nodes)")
    print(f"  intra-op plans for {len(profiles)} (pp, dp, tp) candidates {t2 - t1:7.2f} s")
    print(f"  stage search {t3 - t2:7.2f} s   {stats}")
    print(f"  plan time without tracing: {t3 - t1:7.2f} s")
    if best is None:
        print("  no configuration fits")
        return
    sizes = [len(r) for r in best.stages.ranges(len(best.profile.units))]
    print(f"  autoshard: {best.describe()}")
    print(f"    units per stage {sizes}, peak memory per stage {max(best.stages.memory) / 1e9:.1f} GB, "
          f"bubble {best.bubble_fraction:.3f}")
    mega = profiles.get((16, (mesh.size // 16 // 8, 8)))
    if mega is not None:
        per = args.blocks // 16
        starts = [1 + per * k for k in range(1, 16)]  # embedding on the first stage, head on the last
        for recompute in (True, None):
            ref, _ = search_stages({(16, mega.mesh.shape): mega}, mesh, hardware=hw, memory_limit=hw.memory_bytes,
                                   batch=args.batch, schedules=("1f1b",), starts=starts, recompute=recompute)
            label = "full recompute" if recompute else "recompute where needed"
            if ref is None:
                print(f"  Megatron TP 8 / PP 16 / 1F1B, even stages, {label}: does not fit")
            else:
                print(f"  Megatron TP 8 / PP 16 / 1F1B, even stages, {label}: {ref.describe()}; "
                      f"autoshard / Megatron = {best.step_time / ref.step_time:.3f}")


if __name__ == "__main__":
    main()
