"""Plan time under a binding memory limit against the unconstrained plan, side by side (issue 31, item 10).

    python benchmarks/memory_limit_plan_time.py [--models llama,gpt,mlp] [--mesh 2,2] [--repeat 1]

Tiny models (under 150 K parameters) are planned through ``autoshard.plan`` twice in one process (after
one untimed warm-up plan), one right after the other: without a memory limit, then with ``memory_limit`` at
``--fraction`` of the unconstrained plan's estimated memory, which forces levers and sharding the plan without
them does not pull. Prints both plans' CPU seconds (this process, CP-SAT's threads included: the figure a
shared machine's load disturbs least) and their ratio (the goal: within 3x), the wall seconds, the load
average, the constrained plan's solver status, gap and CP-SAT work, and a hash of each plan's decisions
(``d``: its Solution's JSON without ``solver_stats``, whose work and sizes change when the planner gets
faster) to check that a faster planner chose the same plans.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import DeepMLP


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (8, 8))

    def loss(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())
    return model, {"input_ids": ids}, loss, ids


def tiny_gpt():
    from autoshard.testing.models import gpt
    model, inputs, target, loss_fn = gpt()
    return model, inputs, loss_fn, target


def tiny_mlp():
    return DeepMLP(), (torch.randn(8, 16, 64),), F.mse_loss, torch.randn(8, 16, 64)


MODELS = {"llama": tiny_llama, "gpt": tiny_gpt, "mlp": tiny_mlp}


def _plan(built, mesh, hardware, memory_limit=None):
    model, inputs, loss_fn, target = built
    started, cpu = time.perf_counter(), time.process_time()
    plan = autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware=hardware, memory_limit=memory_limit)
    return plan, time.perf_counter() - started, time.process_time() - cpu


def _decisions(plan) -> str:
    data = plan.solution.to_json()
    data.pop("solver_stats", None)
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _overlapped(plan) -> float:
    """The overlap model's step of ``plan`` (what the planner's finalists are ranked by)."""
    return float((plan.solution.estimated or {}).get("overlapped_step_s", plan.estimated_step_time))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama,gpt,mlp")
    ap.add_argument("--mesh", default="2,2")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--fraction", type=float, default=0.55)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    mesh = tuple(int(s) for s in args.mesh.split(","))
    print(f"{'model':<7} {'params':>7} {'free cpu':>8} {'limited cpu':>11} {'ratio':>6} {'wall s':>13} {'load':>5}  "
          "limit, constrained plan")
    for name in args.models.split(","):
        torch.manual_seed(0)
        built = MODELS[name]()
        params = sum(p.numel() for p in built[0].parameters())
        _plan(built, mesh, args.hardware)  # warm-up, untimed: the first trace in a process pays one-time costs
        for _ in range(args.repeat):
            free, free_s, free_cpu = _plan(built, mesh, args.hardware)
            limit = int(args.fraction * free.estimated_memory)
            limited, limited_s, limited_cpu = _plan(built, mesh, args.hardware, limit)
            stats = limited.solution.solver_stats
            print(f"{name:<7} {params:>7} {free_cpu:>8.2f} {limited_cpu:>11.2f} {limited_cpu / free_cpu:>6.2f} "
                  f"{free_s:>6.1f}/{limited_s:<6.1f} {os.getloadavg()[0]:>5.1f}  "
                  f"{limit} B, status {stats.get('status')}, gap {stats.get('gap')}, work {stats.get('work_s')} s, "
                  f"step {limited.estimated_step_time * 1e6:.2f} us (overlapped {_overlapped(limited) * 1e6:.2f}) vs "
                  f"{free.estimated_step_time * 1e6:.2f} us free, "
                  f"memory {limited.estimated_memory} B; tried {stats.get('accumulation_tried')}; "
                  f"d free {_decisions(free)} limited {_decisions(limited)}", flush=True)


if __name__ == "__main__":
    main()
