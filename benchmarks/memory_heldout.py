"""The whole-step memory peak on models the estimate was not developed on, measured next to estimated.

    python benchmarks/memory_heldout.py [--models mid:llama,mid:opt,mid:gemma] [--meshes 4,2x2]

Issue 27's held-out rows: Hugging Face Llama (7.3 M parameters), OPT and Gemma (4.5 and 4.9 M, tied
heads) with vocabulary 8,192, 8 x 128 tokens per (micro)batch (``autoshard.testing.heldout_models``),
on 4 gloo ranks, meshes (4,) and (2, 2), compiled through ``autoshard.compile`` with the levers
pinned (none, full checkpoint + reshard, selective, accumulation 2) and the placements the planner
chooses. Per case, rank 0's bytes (``autoshard.testing.memory_heldout.heldout_peaks``):

- ``tracker``: ``MicrostepTracker`` (torch's MemTracker that does not hold gradients a real step frees)
  around a step plus AdamW's step, tracking ``cm.local_module`` and the optimizer;
- ``torch MemTracker``: the same with torch's MemTracker as it ships (what issue 27 measured);
- ``bare counter``: live tensor bytes counted by a dispatch mode with no hooks (``storage_probe``), and
  ``heap``: glibc's mmapped bytes (every allocation >= 64 KiB) risen during the step, each plus the
  state alive at its start;
- ``estimated``: ``plan.estimated_memory`` (``passes/solve/peak_timeline.py``), its error against the
  tracker and against the bare counter, and the phase it names. Goal: within 10%, never more than 5% under.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autoshard.testing.memory_heldout import HELDOUT_CASES, heldout_peaks  # noqa: E402
from autoshard.testing.ranks import run_ranks  # noqa: E402


def worker(rank: int, world: int, models, meshes) -> list:
    return heldout_peaks(rank, models, meshes)


def _gap(est: float, measured) -> str:
    return "n/a" if measured is None or math.isnan(measured) else f"{(est - measured) / measured:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid:llama,mid:opt,mid:gemma")
    ap.add_argument("--meshes", default="4,2x2")
    args = ap.parse_args()
    models = args.models.split(",")
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    t0 = time.perf_counter()
    results = run_ranks(worker, 4, models, meshes, timeout=3600)
    print(f"{len(results[0])} cases x 4 ranks in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()}")
    print("| model | mesh | levers | tracker | torch MemTracker | bare counter | heap | estimated | vs tracker | "
          "vs bare | worst rank vs tracker | estimated phase | tracker phase |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(results[0]):
        worst = min((rows[i]["estimated"] - rows[i]["tracker"]) / rows[i]["tracker"] for rows in results)
        plain = "n/a" if math.isnan(r["torch_tracker"]) else f"{r['torch_tracker']:,.0f}"
        heap = "n/a" if r["heap"] is None else f"{r['heap']:,.0f}"
        print(f"| {r['model']} | {r['mesh']} | {r['case']} | {r['tracker']:,.0f} | {plain} | {r['bare']:,.0f} | {heap} "
              f"| {r['estimated']:,.0f} | {_gap(r['estimated'], r['tracker'])} | {_gap(r['estimated'], r['bare'])} "
              f"| {worst:+.1%} | {r['phase']} | {r['tracker_phases']} |")


if __name__ == "__main__":
    main()
