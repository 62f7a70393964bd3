"""Interleaved 1F1B with more than 2 stages per rank and a microbatch count that is not a multiple of
pp trains exactly like one device (2 gloo ranks, pp = 2).

The GPT with tied embeddings, cut at every block and every block's MLP (``gpt_pipeline``'s 8-stage
prefixes: 6 stages for 3 blocks, 8 for 4), runs ``interleaved-1f1b-v3`` and ``interleaved-1f1b-v4``
with 3 microbatches of 2 samples (3 % pp = 1), and ``interleaved-1f1b-v3`` with 1 microbatch (m < pp).
The loss at every step and the parameters after 3 AdamW steps match a single-device copy trained on
the full batch; each rank executes exactly its schedule's compute actions, in order.
"""
from __future__ import annotations

import copy

import torch

from autoshard.testing.equivalence import (Tolerance, adamw, failures_of, pipeline_gradient_mismatches,
                                           train_against_one_device)
from autoshard.testing.models import gpt_pipeline
from autoshard.testing.ranks import run_ranks
from autoshard.passes.solve.context import PlanContext

TOL = Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-6)
MICROBATCH = 2
#: (blocks, schedule, microbatches)
CASES = [(3, "interleaved-1f1b-v3", 3), (4, "interleaved-1f1b-v4", 3), (3, "interleaved-1f1b-v3", 1)]


def interleaved_worker(rank: int, world: int) -> list:
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.schedule.registry import get_schedule
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.executor import RankProgram
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes

    torch.set_num_threads(1)
    failures = []
    plans: dict = {}  # blocks -> (captured, plan JSON): m changes neither the trace nor the stages
    for blocks, name, m in CASES:
        torch.manual_seed(0)
        model, inputs, target, loss_fn, prefixes = gpt_pipeline(n_layer=blocks)
        x, y = tuple(t[:m * MICROBATCH] for t in inputs), target[:m * MICROBATCH]
        v = get_schedule(name).virtual_stages
        case = f"gpt{blocks} pp=2 {name} m={m}"
        if blocks not in plans:
            captured = capture(model, tuple(t[:MICROBATCH] for t in x), loss_fn=loss_fn, target=y[:MICROBATCH])
            payload = None
            if rank == 0:
                nodes = stage_nodes_from_prefixes(captured, prefixes[8])
                assert len(nodes) == 2 * v, (case, len(nodes))
                solve = lambda g, sm: plan_sharding(g.captured, sm, PlanContext.of("cpu", time_limit_s=10))  # noqa: E731
                payload = make_pipeline_plan(captured, nodes, (world,), schedule=name, microbatches=m, virtual=v,
                                             solve=solve).to_json()
            plans[blocks] = captured, broadcast_json(payload, src=0)
        captured, payload = plans[blocks]
        plan = Plan.from_json(dict(payload, schedule=name, microbatches=m))
        schedule = generate(name, world, m)
        prog = RankProgram(plan.attach(captured), schedule=schedule, model=model)
        failures += train_against_one_device(
            case, prog, copy.deepcopy(model), (x, y), loss_fn=loss_fn, steps=3, tol=TOL,
            optimizer=adamw(lr=1e-3, eps=1e-6),
            check_gradients=lambda program, reference: pipeline_gradient_mismatches(case, program, reference, TOL))
        executed = [e.action for e in prog.timeline]
        planned = [str(a) for a in schedule[prog.group] if a.kind in ("F", "B", "W", "BW")]
        if executed != planned:
            failures.append(f"{case}: rank {rank} ran {executed}, the schedule says {planned}")
        del prog
    return failures


def test_interleaved_v3_v4_with_odd_microbatches_match_one_device():
    failures = failures_of(run_ranks(interleaved_worker, 2, timeout=300))
    assert not failures, "\n".join(failures)
