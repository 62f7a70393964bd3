"""Llama-3 8B at sequence 131072 on 8 H100 (batch 1): a plan that fits 80 GB with context parallelism.

    python benchmarks/long_context.py [--time-limit 60] [--seqs 131072,32768]

Hugging Face ``LlamaForCausalLM`` with Llama-3 8B's config, built on the meta device (fp32 master
weights), bf16 compute and fp32 gradient reduction, AdamW, batch 1, on the ``h100`` preset with
``memory_limit=80e9`` bytes per device, mesh (8,). For each sequence length:

- ``autoshard``: the planner's own choice (layout, attention strategy, memory levers);
- ``ring pinned``: the attention pinned sequence-split (``S(2)``, ring attention) with the token ids
  sequence-split, the rest chosen;
- ``ulysses pinned``: the attention pinned head-split (``S(1)``) with the token ids sequence-split,
  the rest chosen, so the ring and Ulysses price side by side in one cost model;
- ``no recompute``: the planner with ``checkpoint="none"`` pinned (does a plan fit without it?).

Printed per plan: its attention strategies, levers, estimated step time, tokens/s/GPU and memory
with its breakdown (``report`` of ``torchtitan_recipes.py``). For scale: torchtitan reports FSDP 8 +
CP at sequence 32768 on 8 H100 using 83.9 GiB (measured, their figure). These are the cost model's
estimates, not measurements.
"""
from __future__ import annotations

import argparse
import os
import time
from collections import Counter

import torch

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.spec import fmt_placements
from torchtitan_recipes import BF16, Recipe, build, lm_loss, report

MESH = (8,)
MEMORY = 80e9


def llama3_8b(seq: int) -> Recipe:
    return Recipe("Llama-3 8B", 32, 4096, 14336, 32, 8, MESH, "h100", MEMORY, 1, seq, "selective", False,
                  "FSDP 8 + CP at 32K: 83.9 GiB")


def attention_summary(plan) -> str:
    found = Counter()
    for name, s in plan.solution.strategies.items():
        if name.startswith("scaled_dot_product_attention"):
            low = ",".join(sorted({l for l in s.lowerings if l})) or "plain"
            found[f"q {fmt_placements(s.inputs[0])} {low}"] += 1
    return "; ".join(f"{k} x{v}" for k, v in sorted(found.items()))


def run(seq: int, time_limit: float) -> None:
    r = llama3_8b(seq)
    hw = get_hardware(r.hardware)
    model = build(r)
    ids = torch.empty(1, seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
    t1 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * params + 12 * r.layers * r.hidden * seq
    print(f"Llama-3 8B, batch 1 x {seq}, mesh {MESH} h100, memory limit {MEMORY / 1e9:.0f} GB; capture {t1 - t0:.1f} s")
    common = dict(hardware=r.hardware, memory_limit=MEMORY, optimizer="adamw", time_limit_s=time_limit,
                  mixed_precision=BF16)
    variants = {
        "autoshard": {},
        "ring pinned": {"pins": {"inputs": {0: ("S(1)",)}, "ops": {"scaled_dot_product_attention*": ("S(2)",)}}},
        "ulysses pinned": {"pins": {"inputs": {0: ("S(1)",)}, "ops": {"scaled_dot_product_attention*": ("S(1)",)}}},
        "no recompute": {"checkpoint": "none"},
    }
    for tag, kw in variants.items():
        t = time.perf_counter()
        try:
            plan = plan_captured(captured, MESH, **common, **kw)
        except autoshard.InfeasiblePlanError as e:
            print(f"  {tag:<18} no plan fits: {str(e).splitlines()[0][:200]}")
            continue
        print(f"  {tag:<18} planned in {time.perf_counter() - t:.1f} s; attention: {attention_summary(plan)}")
        report(tag, plan, r, flops_per_token, hw.flops_bf16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    ap.add_argument("--seqs", default="131072,32768")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for seq in args.seqs.split(","):
        run(int(seq), args.time_limit)
        print()


if __name__ == "__main__":
    main()
