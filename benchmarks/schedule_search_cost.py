"""What the schedules ``pp="auto"`` searches cost the stage search: ``search_stages`` with the default
schedules on GPT-3 175B's shallow profiles (plan_3d.py's model and mesh), in CPU seconds.

    python benchmarks/schedule_search_cost.py [--rounds 3]

The profiles of four (pp, dp, tp) candidates (Megatron-like: the plan_3d winner and deeper
pipelines, each solved to optimality) are built once, then the search runs ``--rounds`` times. The
first round pays for generating and preparing every schedule it simulates (``generators.prepared``
is memoised); the later ones show the search alone. CPU seconds are split into the stage ILP
(CP-SAT runs up to a wall-clock cap, so its CPU follows the machine's load) and the rest (closed
forms, schedule generation, simulations), which is what more searched schedules add to. To compare
two trees, run this script on each, back to back.
"""
from __future__ import annotations

import argparse
import time

import torch

import autoshard.passes.pipeline.stages.search as search
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.layer_costs import layer_units
from autoshard.passes.pipeline.stages.scoring import DEFAULT_SCHEDULES
from autoshard.passes.pipeline.stages.shallow import shallow_program
from plan_3d import gpt3, loss_fn
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch
from autoshard.passes.solve.context import PlanContext

CANDIDATES = [(8, (16, 8)), (16, (16, 4)), (32, (4, 8)), (64, (2, 8))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"default schedules: {DEFAULT_SCHEDULES}")
    model = gpt3(96, 12288, 96, 2048, 51200)
    ids = torch.empty(1536, 2048, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=loss_fn, target=ids.clone())
    shallow = shallow_program(captured, layer_units(captured))
    hw, mesh = get_hardware("h100"), Mesh((128, 8))
    profiles = {}
    for pp, shape in CANDIDATES:
        profiles.update(search.profile_candidates(shallow.captured, mesh, [pp],
                                                  PlanContext.of(hw, optimizer="adamw", time_limit_s=30),
                                                  PipelineSearch(units=shallow.units, blocks=shallow.blocks, deep_chain=True, shapes=[shape])))
    ilp_cpu = [0.0]
    solve = search.solve_stages

    def timed_solve(*a, **kw):
        c = time.process_time()
        try:
            return solve(*a, **kw)
        finally:
            ilp_cpu[0] += time.process_time() - c

    search.solve_stages = timed_solve
    for k in range(args.rounds):
        ilp_cpu[0] = 0.0
        c0, w0 = time.process_time(), time.perf_counter()
        best, stats = search.search_stages(profiles, mesh, PlanContext.of(hw, time_limit_s=600), 1536)
        cpu = time.process_time() - c0
        print(f"round {k}: CPU {cpu:.2f} s (stage ILP {ilp_cpu[0]:.2f} s, the rest {cpu - ilp_cpu[0]:.2f} s), "
              f"wall {time.perf_counter() - w0:.2f} s; configs {stats['configs']}, simulated {stats['simulated']}, "
              f"ILPs {stats['ilp']}, even cuts {stats['even']}; {best.describe()}", flush=True)


if __name__ == "__main__":
    main()
