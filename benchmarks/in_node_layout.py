"""What runs inside a node: GPT-3 6.7B on 2 nodes x 8 H100 whose inter-node link is slow (1 GB/s),
swept over the global batch.

    python benchmarks/in_node_layout.py [--batches 4,8,16,32,64,128,512] [--ilp-limit 10]

For every global batch (sequences of 2048 tokens) the planner searches pp = 1 (any (dp, tp) over all
16 GPUs) and pp = 2 (one node per stage), every in-node (dp, tp) shape, microbatches, schedules and
recompute. The same simulator also prices the layout it rejects most often, data parallel inside
each node (every weight replicated, the batch split 8 ways, pp = 2). Printed per batch: the chosen
layout, how many ways it splits the batch and the attention weights inside the node, its simulated
step time, the data-parallel layout's, and their ratio. Megatron-LM's rule of thumb is tensor
parallel inside the node; the sweep shows where that is the faster layout and where it is not.
The model is Hugging Face's GPT2LMHeadModel with GPT-3 6.7B's shape (32 blocks, width 4096, 32
heads, vocabulary 51200), bf16, AdamW, traced with 2 blocks standing for 32.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

from grid_search import traced

from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.pipeline.stages.candidate_plan import plan_submesh
from autoshard.passes.pipeline.stages.layer_costs import profile_submesh
from autoshard.passes.pipeline.stages.search import profile_candidates, search_stages
from autoshard.passes.pipeline.stages.candidate_plan import CandidateSpec
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch

SLOW_IB = dataclasses.replace(PRESETS["h100"], name="h100, 1 GB/s between nodes", inter_node_bandwidth=1e9)
MESH = Mesh((2, 8))
BLOCKS = 32


def best_layout(batch: int, ilp_limit: float):
    """The planner's choice over pp in {1, 2} and every in-node shape."""
    captured = traced(2, 4096, 32, 2048, batch)
    profiles = profile_candidates(captured, MESH, [1, 2],
                                  PlanContext.of(SLOW_IB, optimizer="adamw", time_limit_s=ilp_limit),
                                  PipelineSearch(blocks=BLOCKS, single=True))
    best, _ = search_stages(profiles, MESH, PlanContext.of(SLOW_IB, time_limit_s=60.0), batch)
    return captured, best


def data_parallel_in_node(captured, batch: int, ilp_limit: float):
    """pp = 2, inside each node every weight replicated and the batch split 8 ways (None when the
    batch has fewer than 8 sequences)."""
    if batch % 8:
        return None
    pins = Pins(params={"*": ("R", "R")}, inputs={0: ("S(0)", "R")})
    sol = plan_submesh(captured, Mesh((8, 1)),
                       PlanContext.of(SLOW_IB, memory_limit=2 * SLOW_IB.memory_bytes, optimizer="adamw", time_limit_s=ilp_limit),
                       CandidateSpec(microbatches=max(1, batch // 8), held=2, repeat=BLOCKS / 2), pins=pins)
    prof = profile_submesh(captured, sol, PlanContext.of(SLOW_IB, optimizer="adamw")).repeat_blocks(BLOCKS)
    best, _ = search_stages({(2, (8, 1)): prof}, MESH, PlanContext.of(SLOW_IB, time_limit_s=60.0), batch)
    return best


def split_ways(choice, fqn: str) -> int:
    pls = choice.profile.solution.param_placements.get(fqn, ())
    return math.prod(choice.profile.mesh.shape[a] for a, p in enumerate(pls) if str(p).startswith("S"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,8,16,32,64,128,512")
    ap.add_argument("--ilp-limit", type=float, default=10.0)
    args = ap.parse_args()
    print(f"GPT-3 6.7B, seq 2048, bf16 AdamW, mesh {MESH.shape} ({SLOW_IB.name}, NVLink inside a node)")
    print("| global batch | chosen layout | batch split in node | attention weights split | step (s) "
          "| DP in node (s) | chosen / DP |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        t0 = time.perf_counter()
        captured, best = best_layout(batch, args.ilp_limit)
        dp = data_parallel_in_node(captured, batch, args.ilp_limit)
        dp_step = dp.step_time if dp is not None else math.nan
        layout = f"pp {best.pp} x (dp {best.profile.mesh.shape[0]}, tp {best.profile.mesh.shape[1]}), m {best.m}, " \
                 f"{best.schedule}" + (", recompute" if any(best.stages.recompute) else "")
        print(f"| {batch} | {layout} | {best.profile.batch_shard} | "
              f"{split_ways(best, 'transformer.h.0.attn.c_attn.weight')} | {best.step_time:.4f} | {dp_step:.4f} | "
              f"{best.step_time / dp_step:.3f} |".replace("nan", "cannot split"), flush=True)
        print(f"<!-- batch {batch}: {time.perf_counter() - t0:.1f} s -->", flush=True)


if __name__ == "__main__":
    main()
