"""Published layouts priced through ``autoshard.plan(layout=...)`` next to autoshard's own plan, under
the same cost model (issue 16 item 7).

    python benchmarks/published_layouts.py [--only 8b,70b,405b,175b,llama3,llama3-v4] [--time-limit 60]

Each row is a meta-device model (nothing allocated), its published layout as an ``autoshard.layouts``
value, and autoshard's plan of the same program:

| key | run | mesh, hardware | batch x seq | published layout |
|---|---|---|---|---|
| 8b | torchtitan Llama-3.1 8B | (8,) h100, 96 GB | 16 x 8192 | ``fsdp(checkpoint="selective")`` |
| 70b | torchtitan Llama-3 70B | (8, 8) a100, 80 GB | 64 x 8192 | ``fsdp(checkpoint="full")`` |
| 405b | torchtitan Llama-3.1 405B | (16, 8) h100, 94 GB | 32 x 8192 | ``fsdp(tp=8, checkpoint="full")`` |
| 175b | GPT-3 175B (Narayanan et al. 2021's configuration class: TP 8, PP 8-16, batch 1536) | (128, 8) h100 | 1536 x 2048 | ``megatron(tp=8, pp=16, recompute="full")`` |
| llama3 | Llama 3 405B (Llama 3 paper, Table 4: TP 8, CP 1, PP 16, DP 128, 16M tokens) | (2048, 8) h100 | 2048 x 8192 | ``megatron(tp=8, pp=16, virtual_stages=2, distributed_optimizer=True)`` |
| llama3-v4 | the same, 4 virtual stages per rank | (2048, 8) h100 | 2048 x 8192 | ``megatron(tp=8, pp=16, virtual_stages=4, distributed_optimizer=True)`` |
| llama3-meta | the same, Meta's layout: 8 virtual stages, the first and last stage the embedding and the head alone | (2048, 8) h100 | 2048 x 8192 | ``megatron(tp=8, pp=16, virtual_stages=8, distributed_optimizer=True, recompute="none", account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)``, priced without the memory limit; autoshard planned under the memory the layout needs |

The torchtitan rows train with bf16 compute and fp32 masters (``MixedPrecision``), as
``torchtitan_recipes.py`` does, and autoshard plans them without a pipeline (``plan_captured``). The
pipelined rows (175b, llama3) hold bf16 parameters (the stage planner traces in the model's dtype)
and autoshard plans them with ``pp="auto"``. Figures: the estimated step (additive: the ILP's sum;
overlap: ``passes/cost/overlap.py``; pipelined: the schedule simulator's), tokens/s/GPU, memory,
plan seconds (wall, capture included), and autoshard / layout (goal <= 1.00). A layout runs on its
logical mesh (tp fastest, then data parallel: torchtitan's FSDP over 64 GPUs is one 64-rank dim);
where that differs from the given mesh, autoshard is also planned on it. The layout's virtual
stage count for Llama 3 (2) and Megatron's microbatch size (1) are assumptions where the papers do
not give them. A pipelined layout is priced with its placements in every stage, Megatron's even
stage cut and its sequence-split residual stream (``autoshard.layout_plans``); its distributed
optimizer as ZeRO-1 (parameters ``R/zero1`` over dp: the optimizer state sharded over dp).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import autoshard
from autoshard import layouts
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.units import human_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_3d import gpt3, loss_fn as lm_loss  # noqa: E402  GPT-3 175B on meta, and the LM loss, as plan_3d builds them

GB = 1e9
BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def llama(layers, hidden, intermediate, heads, kv_heads, seq, dtype=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=128256,
                      max_position_embeddings=seq, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype) if dtype is not None else model


ROWS = {
    "8b": dict(name="torchtitan Llama-3.1 8B / 8 H100", build=lambda: llama(32, 4096, 14336, 32, 8, 8192),
               mesh=(8,), hw="h100", memory=96 * GB, batch=16, seq=8192, layout=layouts.fsdp(checkpoint="selective")),
    "70b": dict(name="torchtitan Llama-3 70B / 64 A100", build=lambda: llama(80, 8192, 28672, 64, 8, 8192),
                mesh=(8, 8), hw="a100", memory=80 * GB, batch=64, seq=8192, layout=layouts.fsdp(checkpoint="full")),
    "405b": dict(name="torchtitan Llama-3.1 405B / 128 H100", build=lambda: llama(126, 16384, 53248, 128, 8, 8192),
                 mesh=(16, 8), hw="h100", memory=94 * GB, batch=32, seq=8192,
                 layout=layouts.fsdp(tp=8, checkpoint="full")),
    "175b": dict(name="GPT-3 175B / 1,024 H100", build=lambda: gpt3(96, 12288, 96, 2048, 51200), mesh=(128, 8), hw="h100", memory=None,
                 batch=1536, seq=2048, layout=layouts.megatron(tp=8, pp=16, recompute="full")),
    "llama3": dict(name="Llama 3 405B / 16,384 H100", model="llama3-405b-bf16",
                   build=lambda: llama(126, 16384, 53248, 128, 8, 8192, dtype=torch.bfloat16),
                   mesh=(2048, 8), hw="h100", memory=None, batch=2048, seq=8192,
                   layout=layouts.megatron(tp=8, pp=16, virtual_stages=2, distributed_optimizer=True)),
    "llama3-v4": dict(name="Llama 3 405B / 16,384 H100, 4 virtual stages", model="llama3-405b-bf16",
                      build=lambda: llama(126, 16384, 53248, 128, 8, 8192, dtype=torch.bfloat16),
                      mesh=(2048, 8), hw="h100", memory=None, batch=2048, seq=8192,
                      layout=layouts.megatron(tp=8, pp=16, virtual_stages=4, distributed_optimizer=True)),
    # Meta's layout (Llama 3 paper, sec. 3.3.2 and Table 4): 8 virtual stages per rank, one block fewer on
    # the first and the last stage (here the embedding alone and the head and loss alone: Megatron-Core's
    # account_for_embedding/loss_in_pipeline_split, 126 blocks + 2 = 128 = 16 x 8 stages), no activation
    # checkpointing at 8K tokens (sec. 3.3.2). Priced without the memory limit (set when the distributed
    # optimizer was priced replicated under a pipeline; it is ZeRO-1 now, whether it fits is not re-checked);
    # autoshard's plan gets the same budget: the memory the layout's plan needs (``ours_under_layout_memory``).
    "llama3-meta": dict(name="Llama 3 405B / 16,384 H100, Meta's layout (v8, embedding and head alone)",
                        model="llama3-405b-bf16", build=lambda: llama(126, 16384, 53248, 128, 8, 8192, dtype=torch.bfloat16),
                        mesh=(2048, 8), hw="h100", memory=1e15, ours_under_layout_memory=True, batch=2048, seq=8192,
                        layout=layouts.megatron(tp=8, pp=16, virtual_stages=8, distributed_optimizer=True,
                                                recompute="none", account_for_embedding_in_pipeline_split=True,
                                                account_for_loss_in_pipeline_split=True)),
}


def line(tag: str, plan, tokens: float, gpus: int, seconds: float) -> dict:
    est = getattr(getattr(plan, "solution", None), "estimated", {}) or {}
    over = est.get("overlapped_step_s")
    step = plan.estimated_step_time
    extra = f", overlap {over:.3f} s ({tokens / gpus / over:,.0f} tok/s/GPU)" if over else ""
    if plan.model_flops:
        extra += f", {plan.model_flops / step / gpus / 1e12:.0f} TFLOP/s/GPU (model FLOPs: autoshard.metrics)"
    shape = (f"pp {plan.pp} x v{plan.virtual}, {plan.schedule}, m {plan.microbatches}, submesh "
             f"{plan.stages[0].mesh.shape}, bubble {100 * plan.bubble_fraction:.1f}%, recompute "
             f"{sum(bool(s.recompute) for s in plan.stages)}/{len(plan.stages)} stages"
             if plan.pipelined else
             f"mesh {plan.mesh.shape}, levers {plan.solution.levers}")
    print(f"  {tag:<12} step {step:.3f} s ({tokens / gpus / step:,.0f} tok/s/GPU){extra}; memory "
          f"{human_bytes(plan.estimated_memory)}; planned in {seconds:.1f} s; {shape}", flush=True)
    return {"step": step, "overlap": over}


#: autoshard's own pipelined plans by what they are planned from: rows that differ only in their layout
#: (llama3, llama3-v4) plan autoshard's side once per process
_OURS: dict = {}


def _signature(r: dict, time_limit: float) -> tuple:
    return (r.get("model", id(r["build"])), r["mesh"], r["hw"], r["memory"], r["batch"], r["seq"], time_limit)


def run(key: str, time_limit: float, layout_only: bool = False) -> None:
    r = ROWS[key]
    gpus = 1
    for s in r["mesh"]:
        gpus *= s
    tokens = r["batch"] * r["seq"]
    print(f"{r['name']}: mesh {r['mesh']} {r['hw']}, batch {r['batch']} x {r['seq']}; layout "
          f"{r['layout'].describe()}", flush=True)
    model = r["build"]()
    ids = torch.empty(r["batch"], r["seq"], dtype=torch.long, device="meta")
    common = dict(hardware=r["hw"], memory_limit=r["memory"], time_limit_s=time_limit)
    pipelined = r["layout"].pp > 1
    t0 = time.perf_counter()
    if layout_only:
        ours = None
    elif pipelined and _signature(r, time_limit) in _OURS:
        ours = _OURS[_signature(r, time_limit)]
        print("  autoshard    (the plan of an earlier row of the same model, mesh and limits)")
    elif pipelined:
        mine = dict(common)
        if r.get("ours_under_layout_memory"):
            # the layout is priced without the device's limit: autoshard gets the same budget, the
            # memory the layout's own plan needs, so the two are compared under one constraint
            mine["memory_limit"] = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss,
                                                  example_target=ids, layout=r["layout"], **common).estimated_memory
            print(f"  autoshard    planned under the layout's own memory, {human_bytes(mine['memory_limit'])}")
        ours = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                              pp="auto", **mine)
        _OURS[_signature(r, time_limit)] = ours
    else:
        captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
        ours = plan_captured(captured, r["mesh"], mixed_precision=BF16, **common)
    t1 = time.perf_counter()
    a = line("autoshard", ours, tokens, gpus, t1 - t0) if ours is not None else None
    try:
        theirs = autoshard.plan(model, r["mesh"], example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                                layout=r["layout"], mixed_precision=None if pipelined else BF16, **common)
    except autoshard.AutoshardError as e:
        print(f"  layout: {type(e).__name__}: {str(e)[:400]}")
        return
    b = line("layout", theirs, tokens, gpus, time.perf_counter() - t1)
    if a is None:
        return
    print(f"  autoshard / layout: {_ratio(a, b)} [goal <= 1.00]", flush=True)
    logical = theirs.mesh.shape
    if not pipelined and logical != tuple(r["mesh"]):
        # the layout runs on its logical mesh (torchtitan flattens FSDP's ranks into one dim): plan there too
        t2 = time.perf_counter()
        flat = plan_captured(captured, logical, mixed_precision=BF16, **common)
        c = line(f"autoshard on {logical}", flat, tokens, gpus, time.perf_counter() - t2)
        print(f"  autoshard on the layout's mesh {logical} / layout: {_ratio(c, b)}", flush=True)


def _ratio(a: dict, b: dict) -> str:
    out = f"{a['step'] / b['step']:.3f}"
    if a["overlap"] and b["overlap"]:
        out += f" additive, {a['overlap'] / b['overlap']:.3f} with overlap"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--layout-only", action="store_true", help="price the layouts, not autoshard's own plans")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for key in args.only.split(","):
        run(key.strip(), args.time_limit, args.layout_only)
        print()


if __name__ == "__main__":
    main()
