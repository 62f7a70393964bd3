"""Published mixture-of-experts runs on H100, priced from their own layouts through
``autoshard.plan(layout=...)``, predicted next to published (issue 28 item 3); with ``--autoshard``
also autoshard's own plan of the same program under the same cost model.

    python benchmarks/published_moe_layouts.py [--only qwen3-30b,dsv3-256] [--time-limit 60] [--autoshard] [--breakdown]

| key | run (source) | mesh | batch x seq | layout |
|---|---|---|---|---|
| qwen3-30b | NeMo AutoModel, Qwen3 MoE 30B-A3B, 8 DGX-H100, BF16: 21.773 s/step, 12,040 tok/s/GPU, 277 TFLOP/s/GPU [1] | (8,) | 512 x 4096 | ``fsdp(ep=8, checkpoint="full", microbatch_size=4)`` [2] |
| dsv3-256 | NeMo AutoModel, DeepSeek V3 671B, 256 DGX-H100, BF16: 8.18 s/step, 1,002 tok/s/GPU, 250 TFLOP/s/GPU [1] | (32, 8) | 512 x 4096 | ``fsdp(pp=4, virtual_stages=8, ep=64, checkpoint="full", reshard_after_forward=False, microbatch_size=1)`` [3] |
| dsv3-report | DeepSeek-V3 technical report (arXiv 2412.19437), 2,048 H800: PP16, EP64 across 8 nodes, ZeRO-1 DP, DualPipe; 180K H800 GPU hours per trillion tokens = 1,543 tok/s/GPU, FP8 GEMMs | (256, 8) | 15360 x 4096 | ``megatron(pp=16, ep=64, distributed_optimizer=True, recompute="none")`` |

[1] NeMo AutoModel performance summary, "Pre-Training Performance, System: DGX-H100, Precision: BF16"
    (docs.nvidia.com/nemo/automodel/latest/performance-summary.html; the same table in the repository's
    docs/performance-summary.md). Columns used: #GPUs, GBS, MBS, LBS, GA, sequence length, TP, PP, CP, EP,
    VP, FSDP, time per global step, model TFLOP/s/GPU, tokens/s/GPU.
[2] github.com/NVIDIA-NeMo/Automodel examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml: FSDP2 with
    ep_size 8, local_batch_size 4 (16 accumulation steps of 4 sequences per GPU), activation_checkpointing
    true, Adam, uniform routing (fake_balanced_gate, which is also what this cost model assumes without
    ``expert_load``).
[3] the same folder, deepseek_v3_te_deepep.yaml: pp_size 4, interleaved 1F1B, pp_microbatch_size 1,
    local_batch_size 8 (8 microbatches), ep_size 64, activation_checkpointing true,
    reshard_after_forward false.

What the pricing leaves out, each a known gap rather than a fitted constant:
- the published runs use Transformer Engine kernels and DeepEP's all-to-all; the cost model prices
  cuBLAS-class GEMMs at its cited rates and the all-to-all as NCCL's at the link bandwidth;
- DeepSeek-V3's report trains with FP8 GEMMs on H800s (NVLink 400 GB/s against the H100's 900):
  the row is priced with the ``h100`` preset in bf16, so the prediction should come out slower than
  the published figure for the precision alone; its DualPipe schedule is priced as 1F1B (a layout's
  schedules are 1F1B, GPipe and interleaved 1F1B), its ZeRO-1 as ``R/zero1`` over dp in every stage,
  and its multi-token-prediction module is not in the Hugging Face model;
- the pipelined rows hold bf16 parameters (the stage planner traces in the model's dtype) and cut the
  blocks evenly over the stages (AutoModel's ``layers_per_stage`` and Megatron's uneven first/last
  stages are not modelled here);
- the Hugging Face models compute the routers' top-k, DeepSeek-V3's group-limited routing included,
  with ordinary ops; the experts are one ``autoshard::moe_experts`` op (no capacity factor: every
  routed pair computed), priced at uniform expert load;
- both NeMo configs set ``fake_balanced_gate: true``: expert ids ``arange(T*k).view(-1, k) % E``, so a
  token's k experts are contiguous (one rank of 8 for Qwen3, one node for DeepSeek-V3 at ep 64), and
  DeepEP sends a token once per destination rank (once per node over RDMA); autoshard's dispatch
  (``runtime/moe_dispatch.py``) and its price move every routed pair, about k times those bytes;
- Hugging Face materialises its causal mask under tracing, so the captured ``sdpa`` carries an explicit
  mask and is priced (and run) as full, not causal, attention; the published runs use TE's causal
  attention and fused RMSNorm (``attn: te``, ``rms_norm: te``), autoshard the eager norm chain.
``--breakdown`` prints the priced step by kind (``moe_breakdown.py``) to attribute these; its
redistribution lines are the listed (unfused) moves x accumulation, above the solution's fused gathers.

A layout this cost model says does not fit the GPUs' memory (when the run itself did) is reported with
the error, then priced at twice the limit, labelled so ("layout@160GB"): a step estimate, not a fit.

Printed per row: the published figures, the layout's estimated step (additive; with overlap where
the plan has it; pipelined: the schedule simulator's), tokens/s/GPU, predicted / published, memory,
plan seconds; with ``--autoshard`` also autoshard's plan and autoshard / layout (goal <= 1.00). These are
cost-model estimates on the meta device, nothing is run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import autoshard
from autoshard import layouts
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from published_layouts import line, _ratio  # noqa: E402  the same report line as the dense rows
from moe_breakdown import price_breakdown  # noqa: E402

GB = 1e9
BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def qwen3_30b(dtype=None):
    """Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 128 experts of 768, top-8, 32 / 4 heads of 128."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False)
    return _meta(Qwen3MoeForCausalLM, cfg, dtype)


def deepseek_v3(dtype=None):
    """deepseek-ai/DeepSeek-V3's config (transformers' DeepseekV3Config defaults): 61 layers (3 dense), hidden
    7168, 256 routed experts of 2048 + 1 shared, top-8 in 4 of 8 groups, MLA; no multi-token prediction."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(num_mtp_layers=0, use_cache=False, max_position_embeddings=4096)
    return _meta(DeepseekV3ForCausalLM, cfg, dtype)


def _meta(cls, cfg, dtype):
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(dtype) if dtype is not None else model


ROWS = {
    "qwen3-30b": dict(name="NeMo AutoModel Qwen3 MoE 30B-A3B / 8 H100", build=qwen3_30b, mesh=(8,), hw="h100",
                      memory=None, batch=512, seq=4096,
                      layout=layouts.fsdp(ep=8, checkpoint="full", microbatch_size=4),
                      published={"step": 21.773, "tok": 12040, "tflops": 277}),
    "dsv3-256": dict(name="NeMo AutoModel DeepSeek V3 671B / 256 H100", build=lambda: deepseek_v3(torch.bfloat16),
                     mesh=(32, 8), hw="h100", memory=None, batch=512, seq=4096,
                     layout=layouts.fsdp(pp=4, virtual_stages=8, schedule="interleaved-1f1b", ep=64,
                                         checkpoint="full", reshard_after_forward=False, microbatch_size=1),
                     published={"step": 8.18, "tok": 1002, "tflops": 250}),
    "dsv3-report": dict(name="DeepSeek-V3 report / 2,048 H800 (priced as H100, bf16)",
                        build=lambda: deepseek_v3(torch.bfloat16), mesh=(256, 8), hw="h100", memory=None,
                        batch=15360, seq=4096,
                        layout=layouts.megatron(pp=16, ep=64, distributed_optimizer=True, recompute="none"),
                        published={"step": 15360 * 4096 / 2048 / 1543, "tok": 1543, "tflops": None}),
}


def run(key: str, time_limit: float, with_autoshard: bool, breakdown: bool = False) -> None:
    r = ROWS[key]
    gpus = 1
    for s in r["mesh"]:
        gpus *= s
    tokens = r["batch"] * r["seq"]
    pub = r["published"]
    print(f"{r['name']}: mesh {r['mesh']} {r['hw']}, batch {r['batch']} x {r['seq']}; layout "
          f"{r['layout'].describe()}", flush=True)
    print(f"  published    step {pub['step']:.3f} s ({pub['tok']:,} tok/s/GPU"
          + (f", {pub['tflops']} TFLOP/s/GPU)" if pub["tflops"] else ")"), flush=True)
    model = r["build"]()
    ids = torch.empty(r["batch"], r["seq"], dtype=torch.long, device="meta")
    common = dict(hardware=r["hw"], memory_limit=r["memory"], time_limit_s=time_limit)
    pipelined = r["layout"].pp > 1
    t0 = time.perf_counter()
    tag = "layout"
    try:
        theirs = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                                layout=r["layout"], mixed_precision=None if pipelined else BF16, **common)
    except autoshard.InfeasiblePlanError as e:
        # the run fits its GPUs; this model says it does not: print why, then price it without that limit
        print(f"  layout: {type(e).__name__}: {str(e)[:400]}", flush=True)
        limit = 2 * (r["memory"] or get_hardware(r["hw"]).memory_bytes)
        tag = f"layout@{limit / GB:.0f}GB"
        theirs = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                                layout=r["layout"], mixed_precision=None if pipelined else BF16,
                                **dict(common, memory_limit=limit))
    b = line(tag, theirs, tokens, gpus, time.perf_counter() - t0)
    step = b["overlap"] or b["step"]
    at_published = f"; {pub['tflops'] * pub['step'] / step:.0f} TFLOP/s/GPU at the published FLOPs per step" \
        if pub["tflops"] else ""
    mfu = f"; MFU {100 * theirs.mfu:.1f}% (autoshard's model FLOPs, dense bf16 peak)" if theirs.mfu else ""
    print(f"  predicted / published step: {b['step'] / pub['step']:.3f} additive"
          + (f", {b['overlap'] / pub['step']:.3f} with overlap" if b["overlap"] else "") + at_published + mfu,
          flush=True)
    if breakdown:
        print("\n".join(price_breakdown(theirs)), flush=True)
    if not with_autoshard:
        return
    t1 = time.perf_counter()
    if pipelined:
        ours = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                              pp="auto", **common)
    else:
        captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
        ours = plan_captured(captured, theirs.mesh.shape, mixed_precision=BF16, **common)
    a = line("autoshard", ours, tokens, gpus, time.perf_counter() - t1)
    print(f"  autoshard / layout: {_ratio(a, b)} [goal <= 1.00]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="qwen3-30b,dsv3-256")
    ap.add_argument("--autoshard", action="store_true", help="also plan each program with autoshard's search")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver work-seconds per plan")
    ap.add_argument("--breakdown", action="store_true", help="print the layout's priced step by op kind")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for key in args.only.split(","):
        run(key.strip(), args.time_limit, args.autoshard, args.breakdown)
        print()


if __name__ == "__main__":
    main()
