"""The Hugging Face zoo: per architecture, trace time, plan time, ops without a sharding rule, and whether
it trains equal to one device on 4 gloo ranks.

    python benchmarks/hf_zoo.py [--mesh 2,2] [--no-train] [--models llama,bert]

Each model is built from its tiny config (``autoshard.testing.hf_zoo``). In this process: the trace
(``capture``: torch.export plus normalization) and the solve (``plan_captured``: strategies, cost
model, ILP; hardware preset "cpu") on ``--mesh``, each timed once per model after one warm-up model,
and the ops left without a rule. Then, unless ``--no-train``, every model runs in one spawn of 4
gloo ranks under the solver's plan and two random plans (``autoshard.testing.zoo_check``, as the
test suite does) and gets its status. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import torch

from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.testing.hf_zoo import KINDS, ZOO, build
from autoshard.testing.ranks import run_ranks
from autoshard.testing.zoo_check import CASES, merge_results, zoo_worker


def time_one(name: str, mesh: Mesh) -> dict:
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build(name)
    t0 = time.perf_counter()
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    t1 = time.perf_counter()
    plan = plan_captured(captured, mesh, hardware="cpu", time_limit_s=30)
    t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    return {"trace_s": t1 - t0, "plan_s": t2 - t1, "nodes": len(captured.gm.graph.nodes), "params": params,
            "unruled": plan.replicated_ops, "status": plan.solution.solver_stats.get("status")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="2,2")
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--no-train", action="store_true")
    args = ap.parse_args()
    names = args.models.split(",")
    mesh = Mesh(tuple(int(s) for s in args.mesh.split(",")))
    time_one(names[0], mesh)  # warm-up: first imports, first export
    rows = {name: time_one(name, mesh) for name in names}
    trained = {}
    if not args.no_train:
        t0 = time.perf_counter()
        trained = merge_results(run_ranks(zoo_worker, 4, names, CASES, timeout=1800))
        print(f"4-rank equivalence of {len(names)} models ({len(CASES)} plans each): "
              f"{time.perf_counter() - t0:.1f} s")
    print(f"\nmesh {mesh.shape}, hardware cpu; cases on 4 ranks: {CASES}\n")
    print("| architecture | kind | params | nodes | trace s | plan s | ops without a rule | 4 ranks = 1 device |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        status = trained[name].status if name in trained else "not run"
        unruled = ", ".join(r["unruled"]) or "none"
        print(f"| {name} | {KINDS[name]} | {r['params']:,} | {r['nodes']} | {r['trace_s']:.2f} | {r['plan_s']:.2f} "
              f"| {unruled} | {status} |")
    for name, res in trained.items():
        for f in res.failures[:5]:
            print(f"  {name}: {f}")


if __name__ == "__main__":
    main()
