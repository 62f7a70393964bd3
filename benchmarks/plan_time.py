"""Plan time for a Llama-3-8B-shaped model on an (8, 8) H100 mesh, tracing included.

    python benchmarks/plan_time.py [--layers 32] [--seq 8192] [--batch 64]

The model is Hugging Face's LlamaForCausalLM built from a config on the meta device (no parameter
memory is allocated). Prints the trace and solve times separately and the chosen layout.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh


def llama3_8b(layers: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=seq, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mesh", default="8,8")
    args = ap.parse_args()
    mesh = Mesh(tuple(int(s) for s in args.mesh.split(",")))
    t0 = time.perf_counter()
    model = llama3_8b(args.layers, args.seq)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    t1 = time.perf_counter()

    def loss_fn(out, target):
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    captured = capture(model, (ids,), loss_fn=loss_fn, target=ids)
    t2 = time.perf_counter()
    plan = plan_captured(captured, mesh, hardware="h100", time_limit_s=60)
    t3 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama-3-8B shape: {args.layers} layers, {n_params / 1e9:.2f} B params, seq {args.seq}, "
          f"global batch {args.batch}, mesh {mesh.shape}, hardware h100")
    print(f"  build model on meta {t1 - t0:6.2f} s")
    print(f"  trace (torch.export) {t2 - t1:6.2f} s   ({len(captured.gm.graph.nodes)} nodes)")
    print(f"  solve (strategies + cost + ILP) {t3 - t2:6.2f} s")
    print(f"  plan() total, trace included: {t3 - t1:6.2f} s")
    print(plan.summary())


if __name__ == "__main__":
    main()
