"""autoshard's 3D plan against the best point of an exhaustive grid, scored by the same cost model.

    python benchmarks/grid_search.py [--suite alpa|megatron|all] [--models 760M,1.3B] [--trace-blocks 2]
                                    [--ilp-limit 3]

For every model: trace ``--trace-blocks`` blocks (identical blocks share costs; the real depth
enters through ``profile_candidates(blocks=L)``), build one intra-op plan per (pp, dp, tp) on the
mesh (GPUs <= 8: one node, mesh (n,); else (n/8, 8)), pp = 1 included as a single stage with
gradient accumulation. The grid: every (pp, dp, tp) x every microbatch count m that divides the
batch x {gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv} x recompute {off, on} on every stage, stages
split evenly by layer count, timed by the schedule simulator, infeasible points (memory) dropped;
points whose bound m * work / pp already exceeds the best are skipped (they cannot win, so the
grid's best is exact). autoshard: ``search_stages`` over the same profiles. Prints a table; the goal
is autoshard / grid <= 1.00 on every row.

Models: Alpa's GPT suite (Zheng et al. 2022, Table 4: seq 1024, batch 1024, vocab 51200) and
Megatron-LM's Table 1 (Narayanan et al. 2021: seq 2048, vocab 51200, their GPU counts and global
batches); the default runs Alpa's suite and Megatron's rows up to 7.5B, the larger ones run with
``--models`` (each has more (pp, dp, tp) candidates, so more intra-op ILPs).
"""
from __future__ import annotations

import argparse
import time

import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.planner import (global_batch, held_microbatches, profile_candidates,
                                               score_stages, search_stages, stage_problem)
from autoshard.passes.pipeline.stages.stage_problem import stage_costs
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch
from autoshard.passes.solve.context import PlanContext

# name: (blocks, width, heads, seq, gpus, global batch)
ALPA = {"760M": (24, 1536, 16, 1024, 2, 1024), "1.3B": (24, 2048, 32, 1024, 4, 1024),
        "2.6B": (32, 2560, 32, 1024, 8, 1024), "6.7B": (32, 4096, 32, 1024, 16, 1024),
        "15B": (48, 5120, 40, 1024, 32, 1024), "39B": (48, 8192, 64, 1024, 64, 1024)}
# Narayanan et al. 2021, Table 1 (their t / p in the comment)
MEGATRON = {"1.7B": (24, 2304, 24, 2048, 32, 512),        # t 1, p 1
            "3.6B": (30, 3072, 32, 2048, 64, 512),        # t 2, p 1
            "7.5B": (36, 4096, 32, 2048, 128, 512),       # t 4, p 1
            "18.4B": (40, 6144, 48, 2048, 256, 1024),     # t 8, p 1
            "39.1B": (48, 8192, 64, 2048, 512, 1536),     # t 8, p 2
            "76.1B": (60, 10240, 80, 2048, 1024, 1792),   # t 8, p 4
            "145.6B": (80, 12288, 96, 2048, 1536, 2304),  # t 8, p 8
            "310.1B": (96, 16384, 128, 2048, 1920, 2160),  # t 8, p 16
            "529.6B": (105, 20480, 128, 2048, 2520, 2520),  # t 8, p 35
            "1T": (128, 25600, 160, 2048, 3072, 3072)}    # t 8, p 64
DEFAULT = list(ALPA) + ["1.7B", "3.6B", "7.5B"]
GRID_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")


def traced(blocks: int, d: int, heads: int, seq: int, batch: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=blocks, n_embd=d, n_head=heads, n_positions=seq, vocab_size=51200, attn_pdrop=0,
                     resid_pdrop=0, embd_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")

    def loss_fn(out, target):
        logits = out.logits if hasattr(out, "logits") else out
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return capture(model, (ids,), loss_fn=loss_fn, target=ids.clone())


def grid_best(profiles, mesh, hw, batch):
    """The best evenly split configuration of the grid (see module docstring)."""
    points = []
    for (p, _), prof in profiles.items():
        L = len(prof.units)
        ms = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % prof.batch_shard == 0]
        for schedule in GRID_SCHEDULES:
            v = get_schedule(schedule).virtual_stages
            S = p * v
            if S > L:
                continue
            for m in ms:
                if not get_schedule(schedule).accepts(p, m):
                    continue
                work = sum(c.fwd(m) + c.bwd(m) for c in prof.costs)
                bound = (m * work + sum(c.grad_sync for c in prof.costs)) / p
                for recompute in (False, True):
                    points.append((bound, p, prof, m, schedule, recompute, [round(s * L / S) for s in range(S)]))
    points.sort(key=lambda t: t[0])
    best, scored = None, 0
    for bound, p, prof, m, schedule, recompute, starts in points:
        if best is not None and bound >= best[0]:
            break
        prob = stage_problem(prof, (p, m, schedule), mesh, PlanContext.of(hw),
                             list(held_microbatches(schedule, p, m)))
        rec = [recompute] * len(starts)
        _, _, mems = stage_costs(prob, starts, rec)
        per = {}
        for s, g in enumerate(prob.stage_group):
            per[g] = per.get(g, 0.0) + mems[s]
        if max(per.values()) > hw.memory_bytes:
            continue
        step, _ = score_stages(prob, schedule, starts, rec)
        scored += 1
        if best is None or step < best[0]:
            dp, tp = prof.mesh.shape
            best = (step, f"pp={p} dp={dp} tp={tp} m={m} {schedule} recompute={'on' if recompute else 'off'}")
    return best, len(points), scored


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="default", choices=["default", "alpa", "megatron", "all"])
    ap.add_argument("--models", default="")
    ap.add_argument("--trace-blocks", type=int, default=2)
    ap.add_argument("--ilp-limit", type=float, default=3.0, help="intra-op ILP seconds per candidate")
    args = ap.parse_args()
    table = {**ALPA, **MEGATRON}
    names = ([m for m in args.models.split(",") if m] or
             {"default": DEFAULT, "alpa": list(ALPA), "megatron": list(MEGATRON), "all": list(table)}[args.suite])
    hw = get_hardware("h100")
    rows = []
    for name in names:
        blocks, d, heads, seq, gpus, batch = table[name]
        mesh = Mesh((gpus,)) if gpus <= 8 else Mesh((gpus // 8, 8))
        t0 = time.perf_counter()
        captured = traced(args.trace_blocks, d, heads, seq, batch)
        t1 = time.perf_counter()
        pps = [p for p in range(1, mesh.shape[0] + 1) if mesh.shape[0] % p == 0 and p <= blocks + 2]
        profiles = profile_candidates(captured, mesh, pps,
                                      PlanContext.of(hw, optimizer="adamw", time_limit_s=args.ilp_limit),
                                      PipelineSearch(blocks=blocks, single=True))
        t2 = time.perf_counter()
        ours, stats = search_stages(profiles, mesh, PlanContext.of(hw, time_limit_s=60.0), global_batch(captured))
        t3 = time.perf_counter()
        grid, points, scored = grid_best(profiles, mesh, hw, batch)
        t4 = time.perf_counter()
        ratio = ours.step_time / grid[0] if ours is not None and grid is not None else float("nan")
        rows.append((name, gpus, ours, grid, ratio, t3 - t1, t4 - t3, points, scored))
        print(f"{name:>6} on {gpus:>3} GPUs: autoshard {ours.describe() if ours else 'nothing fits'}\n"
              f"{'':>18} grid best {grid[1] + f' step={grid[0]:.4g}s' if grid else 'nothing fits'} "
              f"({scored} of {points} points scored)\n"
              f"{'':>18} ratio {ratio:.3f}; trace {t1 - t0:.1f} s, autoshard plan {t3 - t1:.1f} s, grid {t4 - t3:.1f} s",
              flush=True)
    print("\n| model | GPUs | autoshard step (s) | grid best step (s) | autoshard / grid | autoshard layout | grid layout |")
    print("|---|---|---|---|---|---|---|")
    for name, gpus, ours, grid, ratio, *_ in rows:
        print(f"| {name} | {gpus} | {ours.step_time:.4g} | {grid[0]:.4g} | {ratio:.3f} | {ours.describe()} | {grid[1]} |"
              if ours and grid else f"| {name} | {gpus} | - | - | - | nothing fits | |")


if __name__ == "__main__":
    main()
