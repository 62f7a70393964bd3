"""Where a pipeline plan's time goes: CPU seconds (this process, CP-SAT's threads included) of the
planner's phases for GPT-3 175B on (128, 8) or Llama 3 405B on (2048, 8) through
``autoshard.plan(..., pp="auto")``, as ``plan_3d.py`` / ``plan_llama3_405b.py`` plan them.

    python benchmarks/plan_phases.py [--model 175b|405b]

Each phase is a planner function wrapped (for this run only) to add up its inclusive CPU seconds,
counted once when it calls itself; phases nest (``plan_candidates`` holds ``plan_submesh`` holds
``solve``), so the rows do not add up. CPU seconds rather than wall: the machine may be shared, and
the CPU figure is the one other people's load disturbs least (it still grows with load: compare
phases within one run, not across runs). cProfile inflates the pure-Python phases (tracing, the
schedule simulator) several times over; this wrapper costs microseconds per call.
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import time

import torch

import autoshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_3d import gpt3, loss_fn  # noqa: E402
from plan_llama3_405b import describe  # noqa: E402
from published_layouts import llama  # noqa: E402

_S = "autoshard.passes.pipeline.stages."
#: (module, function or Class.method, what it is)
PHASES = [
    ("autoshard.passes.capture.export", "capture", "trace (torch.export + normalization)"),
    ("autoshard.passes.solve.planner", "plan_sharding", "the no-pipeline plan on the whole mesh"),
    (_S + "search", "plan_candidates", "intra-op plans of every (pp, dp, tp) candidate"),
    (_S + "candidate_plan", "plan_submesh", "  one candidate's intra-op plan"),
    ("autoshard.passes.solve.problem", "build_strategy_graph", "    its strategy graph (cost tables)"),
    ("autoshard.passes.solve.hint_plans", "pinned_choices", "    published-layout hint solves"),
    ("autoshard.passes.solve.ilp", "solve", "    ILP solves (LP + CP-SAT, hints' included)"),
    ("autoshard.passes.solve.ilp", "ShardingILP.lp_relaxation", "      GLOP LP relaxations"),
    ("autoshard.passes.solve.ilp", "ShardingILP.solve_cpsat", "      CP-SAT"),
    (_S + "search", "search_stages", "stage search (m, schedule, cut, recompute)"),
    (_S + "scoring", "score_stages", "  simulated configurations"),
    ("autoshard.passes.pipeline.schedule.generators", "generate", "    schedules generated"),
    (_S + "search", "_even_cuts", "  even cuts"),
    (_S + "stage_ilp", "solve_stages", "  stage ILPs"),
    (_S + "planner", "_build", "the plan of the deep program"),
]


def _wrap(total: dict, count: collections.Counter, depth: collections.Counter, label: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        depth[label] += 1
        c = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[label] -= 1
            if depth[label] == 0:
                total[label] += time.process_time() - c
                count[label] += 1
    return timed


def install() -> tuple[dict, collections.Counter]:
    """Wrap every phase where it is defined and wherever a module imported it by name."""
    total: dict = collections.defaultdict(float)
    count, depth = collections.Counter(), collections.Counter()
    for module, name, _ in PHASES:
        mod = importlib.import_module(module)
        if "." in name:
            cls, attr = name.split(".")
            owner = getattr(mod, cls)
            setattr(owner, attr, _wrap(total, count, depth, name, getattr(owner, attr)))
            continue
        fn = getattr(mod, name)
        timed = _wrap(total, count, depth, name, fn)
        for m in list(sys.modules.values()):
            for key, value in list(getattr(m, "__dict__", {}).items()):
                if value is fn:
                    setattr(m, key, timed)
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("175b", "405b"), default="175b")
    args = ap.parse_args()
    for module in {m for m, _, _ in PHASES}:
        importlib.import_module(module)
    total, count = install()
    if args.model == "175b":
        model, mesh, batch, seq = gpt3(96, 12288, 96, 2048, 51200), (128, 8), 1536, 2048
    else:
        model, mesh, batch, seq = llama(126, 16384, 53248, 128, 8, 8192, dtype=torch.bfloat16), (2048, 8), 2048, 8192
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    load = os.getloadavg()[0]
    t, c = time.perf_counter(), time.process_time()
    plan = autoshard.plan(model, mesh, example_inputs=(ids,), loss_fn=loss_fn, example_target=ids.clone(),
                          hardware="h100", pp="auto", time_limit_s=60.0)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(f"{args.model} on {mesh}: autoshard.plan {wall:.1f} s wall, {cpu:.1f} CPU s; load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for _, name, what in PHASES:
        print(f"  {what:<48} {total.get(name, 0.0):7.2f} CPU s  ({count.get(name, 0)} calls)")
    print(f"  plan: {describe(plan)}")


if __name__ == "__main__":
    main()
