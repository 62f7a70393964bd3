"""The IOPDDL solver on the sharding planner's own problems, next to the planner's ILP.

    python benchmarks/iopddl_planner_graphs.py [--limit 10]

Builds the planner's ``StrategyGraph`` (``passes/solve/planner.py``: strategies, clusters, cost
model, the device's memory as the limit) for a Llama-3-8B-shaped model (32 layers, seq 8192,
batch 8) and a GPT-3-175B-shaped one (2 traced blocks of width 12288, seq 2048, batch 16; the 3D
planner's per-stage problem), both on an (8, 8) H100 mesh; solves it with the planner's ILP
(``passes/solve/ilp.py``) and, converted with ``problem.from_strategy_graph``, with
``solve_problem`` (the IOPDDL solver), each with the same time limit; prints graph sizes, each
one's objective (seconds per step), time and the IOPDDL solver's lower bound. Nothing here changes
what the planner does: it measures what the solver could bring it.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.model import CostModel
from autoshard.contest.iopddl.problem import IOPDDLFormatError, from_strategy_graph
from autoshard.contest.iopddl.solver import solve_problem
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.ilp import solve
from autoshard.passes.solve.problem import build_problem


def loss_fn(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def llama3_8b():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16), torch.empty(8, 8192, dtype=torch.long, device="meta")


def gpt3_175b_two_blocks():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=12288, n_head=96, n_positions=2048, vocab_size=51200, attn_pdrop=0,
                     resid_pdrop=0, embd_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg).to(torch.bfloat16), torch.empty(16, 2048, dtype=torch.long, device="meta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=10.0, help="seconds for each solver")
    args = ap.parse_args()
    mesh = Mesh((8, 8))
    print(f"load average {os.getloadavg()[0]:.1f}; each solver {args.limit:.0f} s")
    for name, build in (("Llama-3 8B", llama3_8b), ("GPT-3 175B (2 blocks)", gpt3_175b_two_blocks)):
        model, ids = build()
        captured = capture(model, (ids,), loss_fn=loss_fn, target=ids.clone())
        problem = build_problem(captured, mesh, hardware=PRESETS["h100"])
        cm = CostModel(problem.mesh, problem.hardware, "adamw")
        graph = problem.strategy_graph(cm, float(problem.hardware.memory_bytes))
        size = sum(len(n.cost) for n in graph.nodes)
        print(f"{name}: {len(graph.nodes)} nodes, {len(graph.edges)} edges, {size} strategies")
        t = time.perf_counter()
        ilp = solve(graph, time_limit_s=args.limit, workers=2)
        print(f"  planner ILP   {time.perf_counter() - t:6.2f} s  objective {ilp.cost:.6g} s  status {ilp.status}")
        try:
            p = from_strategy_graph(graph)
        except IOPDDLFormatError as e:
            print(f"  IOPDDL solver: cannot express this graph ({e})")
            continue
        t = time.perf_counter()
        res = solve_problem(p, args.limit)
        wall = time.perf_counter() - t
        cost = None if res.cost is None else res.cost * 1e-9
        bound = None if res.lower_bound is None else res.lower_bound * 1e-9
        print(f"  IOPDDL solver {wall:6.2f} s  objective {cost if cost is None else f'{cost:.6g}'} s  "
              f"status {res.status}  mode {res.stats.get('mode')}  lower bound {bound}")


if __name__ == "__main__":
    main()
