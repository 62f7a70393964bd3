"""torchtitan's published Llama recipes planned by ``autoshard.plan``, next to the same cost model's
estimate for torchtitan's own layout pinned.

    python benchmarks/torchtitan_recipes.py [--only 8b,70b,405b] [--time-limit 60]

Each model is Hugging Face's ``LlamaForCausalLM`` built from its config on the meta device (fp32
master weights, nothing allocated), trained with bf16 compute and fp32 gradient reduction
(``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``, as torchtitan's FSDP2 does) and
AdamW, at torchtitan's global batch, on a hardware preset with the memory of the cards torchtitan
measured on (``memory_limit``):

| recipe | mesh, hardware | batch | torchtitan's layout | torchtitan's figure |
|---|---|---|---|---|
| Llama-3.1 8B | (8,) h100, 96 GB cards | 16 x 8192 | FSDP + selective AC | 5,762 tok/s/GPU, 82.4 GiB |
| Llama-3 70B | (8, 8) a100 80 GB | 64 x 8192 | FSDP + full AC | 331 tok/s/GPU, 51.7% MFU |
| Llama-3.1 405B | (16, 8) h100, 94 GB cards | 32 x 8192 | FSDP 16 x TP 8 + full AC | 109 tok/s/GPU |

For each: the capture and planning wall time (goal: <= 60 s on the 2-core box, capture included),
autoshard's choice (levers and parameter layout), its estimated tokens/s/GPU, memory and MFU, and
the same for torchtitan's layout pinned (parameter placements, checkpoint policy, reshard after
forward, no accumulation) from the same captured program; the ratio autoshard / torchtitan-layout
of estimated step times (goal <= 1.00). MFU = tokens/s/GPU x FLOPs per token / the preset's dense
bf16 peak, FLOPs per token = 6 x parameters + 12 x layers x hidden x sequence (torchtitan's
formula, attention included). The estimates are the cost model's, not measurements; torchtitan's
measured figures are printed next to them for scale.
"""
from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.units import human_bytes

GB = 1e9
BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass
class Recipe:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    mesh: tuple
    hardware: str
    memory: float  # bytes per card torchtitan measured on
    batch: int
    seq: int
    checkpoint: str
    tp: bool  # torchtitan's layout has tensor parallel on the last mesh axis
    measured: str


RECIPES = {
    "8b": Recipe("Llama-3.1 8B", 32, 4096, 14336, 32, 8, (8,), "h100", 96 * GB, 16, 8192, "selective", False,
                 "5,762 tok/s/GPU, 82.4 GiB"),
    "70b": Recipe("Llama-3 70B", 80, 8192, 28672, 64, 8, (8, 8), "a100", 80 * GB, 64, 8192, "full", False,
                  "331 tok/s/GPU, 51.7% MFU"),
    "405b": Recipe("Llama-3.1 405B", 126, 16384, 53248, 128, 8, (16, 8), "h100", 94 * GB, 32, 8192, "full", True,
                   "109 tok/s/GPU"),
}


def build(r: Recipe):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=r.hidden, intermediate_size=r.intermediate, num_hidden_layers=r.layers,
                      num_attention_heads=r.heads, num_key_value_heads=r.kv_heads, vocab_size=128256,
                      max_position_embeddings=r.seq, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def torchtitan_layout(r: Recipe) -> dict:
    """torchtitan's parameter placements: FSDP shards dim 0 over the data-parallel axes; with TP,
    q/k/v/gate/up and the head column-wise (dim 0), o/down row-wise (dim 1), the embedding on the
    vocabulary (dim 0), norms replicated over the TP axis."""
    if not r.tp:
        return {"params": {"*": tuple("S(0)" for _ in r.mesh)}, "inputs": {0: tuple("S(0)" for _ in r.mesh)}}
    params = {"*norm.weight": ("S(0)", "R")}
    for pattern in ("*q_proj.weight", "*k_proj.weight", "*v_proj.weight", "*gate_proj.weight", "*up_proj.weight",
                    "lm_head.weight", "model.embed_tokens.weight"):
        params[pattern] = ("S(0)", "S(0)")
    for pattern in ("*o_proj.weight", "*down_proj.weight"):
        params[pattern] = ("S(0)", "S(1)")
    return {"params": params, "inputs": {0: ("S(0)", "R")}}


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def report(tag: str, plan, r: Recipe, flops_per_token: float, peak: float) -> float:
    sol = plan.solution
    gpus = 1
    for s in r.mesh:
        gpus *= s
    tokens = r.batch * r.seq / gpus / plan.estimated_step_time
    mfu = tokens * flops_per_token / peak
    levers = sol.levers
    blocks = "; ".join(f"{t}: ckpt={p.checkpoint}, reshard={p.reshard_after_forward}" for t, p in levers.blocks.items())
    print(f"  {tag:<18} step {plan.estimated_step_time:8.3f} s  {tokens:8.0f} tok/s/GPU  MFU {100 * mfu:5.1f}%  "
          f"memory {human_bytes(plan.estimated_memory)}  accumulation {levers.accumulation}  "
          f"blocks [{blocks or 'keep everything'}]")
    phases = ", ".join(f"{k[5:-6].replace('_', ' ')} {human_bytes(v)}" for k, v in sol.estimated.items()
                       if k.startswith("peak_") and k.endswith("_bytes"))
    print(f"  {'':<18} memory peak {human_bytes(plan.estimated_memory)} in the {sol.memory_peak_phase} "
          f"(per phase: {phases})")
    print(f"  {'':<18} memory by category: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sol.memory_breakdown.items() if v)
          + "; time: " + ", ".join(f"{k} {v:.3f} s" for k, v in sol.time_breakdown.items() if v))
    est = sol.estimated
    if "overlapped_step_s" in est:  # the same plan with communication on its own stream (passes/cost/overlap.py)
        over = est["overlapped_step_s"]
        print(f"  {'':<18} with overlap: step {over:.3f} s, {r.batch * r.seq / gpus / over:.0f} tok/s/GPU; "
              f"communication exposed {est['exposed_communication_s']:.3f} s, hidden {est['hidden_communication_s']:.3f} s")
    return plan.estimated_step_time


def run(key: str, time_limit: float) -> None:
    r = RECIPES[key]
    hw = get_hardware(r.hardware)
    print(f"{r.name}: mesh {r.mesh} {r.hardware} ({human_bytes(r.memory)} cards), batch {r.batch} x {r.seq}, "
          f"bf16 compute / fp32 masters, AdamW; torchtitan: {r.measured}")
    t0, c0 = time.perf_counter(), cpu_seconds()
    model = build(r)
    t1, c1 = time.perf_counter(), cpu_seconds()
    ids = torch.empty(r.batch, r.seq, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
    t2, c2 = time.perf_counter(), cpu_seconds()
    ours = plan_captured(captured, r.mesh, hardware=r.hardware, memory_limit=r.memory, optimizer="adamw",
                         time_limit_s=time_limit, mixed_precision=BF16)
    t3, c3 = time.perf_counter(), cpu_seconds()
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * params + 12 * r.layers * r.hidden * r.seq
    print(f"  build on meta {t1 - t0:.1f} s; capture {t2 - t1:.1f} s (cpu {c2 - c1:.1f}); plan {t3 - t2:.1f} s "
          f"(cpu {c3 - c2:.1f}); capture + plan {t3 - t1:.1f} s [goal <= 60 s]; {params / 1e9:.2f} B parameters, "
          f"{len(captured.gm.graph.nodes)} nodes; solver {ours.solution.solver_stats.get('accumulation_tried')}")
    mine = report("autoshard", ours, r, flops_per_token, hw.flops_bf16)
    layout = torchtitan_layout(r)
    try:
        theirs = plan_captured(captured, r.mesh, hardware=r.hardware, memory_limit=r.memory, optimizer="adamw",
                               time_limit_s=time_limit, mixed_precision=BF16, pins=layout, accumulation=1,
                               checkpoint=r.checkpoint, reshard_after_forward=True)
    except autoshard.InfeasiblePlanError as e:
        print(f"  torchtitan layout: does not fit {human_bytes(r.memory)} in this cost model: {str(e)[:300]}")
        return
    tt = report("torchtitan layout", theirs, r, flops_per_token, hw.flops_bf16)
    print(f"  autoshard / torchtitan-layout estimated step time: {mine / tt:.3f} [goal <= 1.00]")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="8b,70b,405b")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for key in args.only.split(","):
        run(key.strip(), args.time_limit)
        print()


if __name__ == "__main__":
    main()
