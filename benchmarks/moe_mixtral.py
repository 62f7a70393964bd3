"""Mixtral 8x7B on 64 H100s: autoshard's plan next to the hand layout "expert parallel 8 inside the
node, FSDP across nodes", both priced by the same cost model.

    python benchmarks/moe_mixtral.py [--time-limit 60] [--layers 32]

The model is Hugging Face's ``MixtralForCausalLM`` at Mixtral 8x7B's config (32 layers, hidden 4096,
8 experts of intermediate 14336, top-2, 32 heads / 8 KV heads, vocabulary 32000; 46.7 B parameters)
built on the meta device (fp32 master weights, nothing allocated), trained with bf16 compute and fp32
gradient reduction and AdamW at global batch 256 x 4096 on a (8, 8) mesh of the ``h100`` preset:
axis 0 across the 8 nodes, axis 1 the 8 GPUs of a node. Its MoE layers are captured as
``autoshard::moe_experts`` ops, which the planner may run data parallel, tensor parallel inside the
experts, expert parallel (all-to-all) or a combination per mesh axis.

The hand layout, pinned from the same captured program (``pins``): every MoE layer expert parallel
over the node axis (8 experts, one per GPU, tokens dispatched by all-to-all) and data parallel
across nodes; expert weights stored ``(S(1), S(0))`` (FSDP across nodes on the expert's row dim,
experts split inside the node), every other parameter FSDP-sharded over all 64 GPUs (dim 0; the
router's (8, 4096) weight on dim 1), the batch split over both axes. Memory levers (recomputation,
accumulation, reshard after forward) are chosen by the planner for both, so the comparison is of
layouts. Printed: planning time, each plan's estimated step time, memory, tokens/s/GPU, the
estimated all-to-all share of the step, and the ratio autoshard / hand layout (goal <= 1.00). These
are cost-model estimates, not measurements.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.moe import dispatch_collectives, moe_nodes
from autoshard.passes.levers import MixedPrecision
from autoshard.passes.sharding.rules.moe import moe_role
from autoshard.passes.solve.solution import pricing_for
from autoshard.passes.spec import Replicate, Shard, Strategy
from autoshard.passes.units import human_bytes

MESH = (8, 8)
BATCH, SEQ = 256, 4096
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build(layers: int):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=SEQ, router_jitter_noise=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return MixtralForCausalLM(cfg)


def lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hand_layout(captured) -> dict:
    """EP 8 inside the node (axis 1), data parallel / FSDP across nodes (axis 0)."""
    s0, r = Shard(0), Replicate()
    tokens = ((s0, s0),) * 3
    experts = ((r, s0),) * 3
    ep = Strategy(tokens + experts, ((s0, s0),), (None, "expert_dispatch"))
    params = {fqn: ("S(1)", "S(0)") if ".experts." in fqn else ("S(1)", "S(1)") if fqn.endswith("mlp.gate.weight")
              else ("S(0)", "S(0)") for fqn in captured.params.values()}  # the router (8, 4096): FSDP on dim 1
    return {"params": params,
            "inputs": {0: ("S(0)", "S(0)")},
            "strategies": {n.name: ep for n in moe_nodes(captured.gm)}}


def all_to_all_seconds(plan, captured, hw) -> float:
    """Estimated seconds per step of the MoE layers' all-to-alls under ``plan`` (all microsteps)."""
    sol = plan.solution
    k = sol.levers.accumulation
    facts, cm = pricing_for(captured, plan.mesh, hw, "adamw", k, BF16, traced_at_microbatch=True)
    total = 0.0
    for node in moe_nodes(captured.gm):
        colls = dispatch_collectives(cm, node, sol.strategies[node.name], facts.tensor_outputs(node.name)[0],
                                     facts.training)
        total += sum(c.seconds for c in colls)
    return total * k


def report(tag: str, plan, captured, hw) -> float:
    sol = plan.solution
    tokens = BATCH * SEQ / 64 / plan.estimated_step_time
    a2a = all_to_all_seconds(plan, captured, hw)
    roles = sorted({", ".join(moe_role(st, a) for a in range(2)) for n, st in sol.strategies.items()
                    if n.startswith("moe_experts")})
    levers = sol.levers
    blocks = "; ".join(f"{t}: ckpt={p.checkpoint}, reshard={p.reshard_after_forward}" for t, p in levers.blocks.items())
    print(f"  {tag:<12} step {plan.estimated_step_time:8.3f} s  {tokens:8.0f} tok/s/GPU  memory "
          f"{human_bytes(plan.estimated_memory)}  all-to-all {a2a:.3f} s ({100 * a2a / plan.estimated_step_time:.1f}% "
          f"of the step)  accumulation {levers.accumulation}  blocks [{blocks or 'keep everything'}]")
    print(f"  {'':<12} MoE layers (axis 0 across nodes, axis 1 in node): {roles}")
    print(f"  {'':<12} time: " + ", ".join(f"{k} {v:.3f} s" for k, v in sol.time_breakdown.items() if v)
          + "; memory: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sol.memory_breakdown.items() if v))
    return plan.estimated_step_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    hw = get_hardware("h100")
    t0 = time.perf_counter()
    model = build(args.layers)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
    t1 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"Mixtral 8x7B ({args.layers} layers, {params / 1e9:.2f} B parameters), mesh {MESH} h100, batch "
          f"{BATCH} x {SEQ}, bf16 compute / fp32 masters, AdamW; capture {t1 - t0:.1f} s, "
          f"{len(captured.gm.graph.nodes)} nodes")
    ours = plan_captured(captured, MESH, hardware="h100", optimizer="adamw", time_limit_s=args.time_limit,
                         mixed_precision=BF16)
    t2 = time.perf_counter()
    print(f"  autoshard plan {t2 - t1:.1f} s")
    mine = report("autoshard", ours, captured, hw)
    theirs = plan_captured(captured, MESH, hardware="h100", optimizer="adamw", time_limit_s=args.time_limit,
                           mixed_precision=BF16, pins=hand_layout(captured))
    print(f"  hand layout plan {time.perf_counter() - t2:.1f} s")
    hand = report("EP8 x FSDP8", theirs, captured, hw)
    print(f"  autoshard / hand-layout estimated step time: {mine / hand:.3f} [goal <= 1.00]")


if __name__ == "__main__":
    main()
