"""Pipeline boundaries sent as planned pieces against sent whole, side by side on 4 gloo ranks.

    python benchmarks/pipeline_boundaries.py [--d 256 --layers 4 --seq 128 --batch 32 --micro 4 --rounds 6]

A GPT (``autoshard.testing.models``) cut into 2 stages, each on a rank group of 2 ranks running data
parallel (mesh (2, 2): pp = 2 x dp = 2; every activation ``S(0)`` over dp). Both sides run the same
plan and schedule (1F1B). "pieces": today's runtime, each rank sends its own rows to its peer
(``runtime/pipeline/boundaries.py``, the bytes the stage planner prices). "whole": the runtime as it
was before, emulated by giving every boundary value ``R``: the sending group gathers each value and
every rank sends all of it, the receiver chunks it. Rounds alternate the two (ABBA) so machine
noise hits both. Prints each side's median ms/step, the ratio of medians (pieces / whole; below 1.0:
pieces are faster), the bytes one rank sends per step on each side, and the loss of each side's
first step (they must agree: the same maths).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from autoshard.passes.solve.context import PlanContext


def worker(rank: int, world: int, args: dict) -> dict:
    import autoshard.runtime.executor as executor
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.passes.spec import Replicate
    from autoshard.runtime.groups import broadcast_json
    from autoshard.testing.models import GPT, lm_loss

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d, layers, seq, batch, micro = args["d"], args["layers"], args["seq"], args["batch"], args["micro"]
    model = GPT(256, d, layers, 4, seq, False)
    ids = torch.randint(0, 256, (batch, seq))
    target = torch.randint(0, 256, (batch, seq))
    mb = batch // micro
    captured = capture(model, (ids[:mb],), loss_fn=lm_loss, target=target[:mb])
    payload = None
    if rank == 0:
        nodes = stage_nodes_from_prefixes(captured, [f"blocks.{layers // 2}"])

        def solve(graph, submesh):
            names = list(graph.captured.inputs) + ([graph.captured.target] if graph.captured.target else [])
            return plan_sharding(graph.captured, submesh, PlanContext.of("cpu", time_limit_s=10),
                                 pins=Pins(params={"*": ("R",)}, inputs={n: ("S(0)",) for n in names}))
        payload = make_pipeline_plan(captured, nodes, (2, 2), schedule="1f1b", microbatches=micro,
                                     solve=solve).to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0))
    schedule = generate("1f1b", 2, micro)
    planned = executor.boundary_placements

    def whole(plan_, graphs, strategies):
        return {name: (Replicate(),) * plan_.stages[g.index].mesh.ndim for g in graphs for name, _ in g.sends}

    programs = {}
    for side, rule in (("pieces", planned), ("whole", whole)):
        executor.boundary_placements = rule
        programs[side] = executor.RankProgram(plan.attach(captured), schedule=schedule, model=model)
    executor.boundary_placements = planned
    sent = {}
    for side, prog in programs.items():
        w = prog.wiring
        mine = [v for s in prog.stages for v, _ in w.sends[s]]
        sent[side] = sum(torch.Size(w.meta[v][0]).numel() * w.meta[v][1].itemsize for v in mine) * micro
    times = {"pieces": [], "whole": []}
    first_loss = {}
    for r in range(args["rounds"]):
        order = ("pieces", "whole") if r % 2 == 0 else ("whole", "pieces")
        for side in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = programs[side].step(ids, target=target)
            dist.barrier()
            if r > 0:  # the first round warms both up
                times[side].append(time.perf_counter() - t0)
            first_loss.setdefault(side, float(loss))
    return {"times": times, "sent": sent, "loss": first_loss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    args = vars(ap.parse_args())
    from autoshard.testing.ranks import run_ranks
    load = os.getloadavg()[0]
    results = run_ranks(worker, 4, args, timeout=1800)
    after = os.getloadavg()[0]
    med = {side: statistics.median(max(r["times"][side][k] for r in results)
                                   for k in range(len(results[0]["times"][side]))) for side in ("pieces", "whole")}
    print(f"GPT d={args['d']} layers={args['layers']} seq={args['seq']} batch={args['batch']} in {args['micro']} "
          f"microbatches, pp 2 x dp 2 on 4 gloo ranks, 1F1B; load average {load:.1f} before, {after:.1f} after")
    for side in ("pieces", "whole"):
        sent = max(r["sent"][side] for r in results)
        print(f"  {side:<7} median {1e3 * med[side]:8.1f} ms/step (slowest rank), sends {sent / 1e6:7.2f} MB of "
              f"activations per rank per step (and as many gradient bytes back), first loss "
              f"{results[0]['loss'][side]:.6f}")
    print(f"  pieces / whole = {med['pieces'] / med['whole']:.3f}")


if __name__ == "__main__":
    main()
