"""Pipeline-parallel runtime: equivalence with one device, measured order = schedule order.

For the GPT with tied embeddings and the U-Net-like model (long skips), on 4 gloo ranks (pp=4;
pp=2 x dp=2; pp=2 x tp=2) and 8 ranks (pp=2 x dp=2 x tp=2), under every schedule available: the
loss at every step and the full parameters after 2 AdamW steps match a single-device copy trained
on the full batch (rtol 1e-4), and each rank's executed compute actions are its schedule's compute
actions in order. With data parallel inside the stages, every stage launches gradient all-reduce
buckets during its last weight action (BW through autograd hooks, zero-bubble W through
``mark_ready``). DualPipeV needs m >= 2p microbatches: at pp=4 it runs 8 microbatches of the
traced size on a global batch of 16 (``larger_batch``); every other case runs 4 on a batch of 8.
One process spawn per world size; every case runs inside it, each plan made once on one of the ranks
(``shared_work.spread_over_ranks``). The front door
(``autoshard.compile(..., pp=...)``) is tested in test_pipeline_auto.py.
"""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from autoshard.testing.equivalence import (Tolerance, adamw, failures_of, pipeline_gradient_mismatches,
                                           train_against_one_device)
from autoshard.testing.models import PIPELINE_BUILDERS, unet
from autoshard.testing.ranks import run_ranks
from autoshard.testing.shared_work import spread_over_ranks
from autoshard.passes.solve.context import PlanContext

STEPS = 2  # the first step checks gradients and loss, the second the optimizer state carried over
TOL = Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-6)
ADAM_EPS = 1e-6
MICROBATCHES = 4

# Megatron-style column / row Linears per model (tensor-parallel layout inside each stage).
TP_LAYERS = {
    "gpt": ([f"blocks.{i}.{n}" for i in range(4) for n in ("q", "k", "v", "fc")],
            [f"blocks.{i}.{n}" for i in range(4) for n in ("o", "out")]),
    "unet": (["down.0", "down.2", "up.0", "up.2"], ["down.1", "down.3", "up.1", "up.3"]),
}


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]


def microbatches_for(schedule: str, pp: int) -> int:
    """MICROBATCHES, or 2 * pp for DualPipeV, which needs m >= 2p."""
    return max(MICROBATCHES, 2 * pp) if schedule == "dualpipev" else MICROBATCHES


def larger_batch(tensors: tuple, factor: int) -> tuple:
    """The batch and ``factor - 1`` new ones (each rolled one step along its last dim: new samples, same
    dtype and range), so more microbatches keep the traced microbatch size."""
    return tuple(torch.cat([t.roll(k, dims=-1) for k in range(factor)]) for t in tensors)


def stage_pins(layout: str, model_name: str, sub, submesh) -> dict:
    """Pins for one stage's sub-graph: data parallel, Megatron TP, or both, restricted to its params."""
    nd = submesh.ndim
    have = set(sub.params.values()) | set(sub.aliases)
    names = list(sub.inputs) + ([sub.target] if sub.target else [])
    if layout == "single":
        return {}
    if layout == "dp":
        return {"params": {"*": ("R",) * nd}, "inputs": {n: ("S(0)",) * nd for n in names}}
    col, row = TP_LAYERS[model_name]
    on_tp = lambda pl: tuple(pl if a == nd - 1 else "R" for a in range(nd))  # noqa: E731
    params = {}
    for n in col:
        params[f"{n}.weight"], params[f"{n}.bias"] = on_tp("S(0)"), on_tp("S(0)")
    for n in row:
        params[f"{n}.weight"], params[f"{n}.bias"] = on_tp("S(1)"), on_tp("R")
    batch = tuple("R" if a == nd - 1 else "S(0)" for a in range(nd))
    return {"params": {k: v for k, v in params.items() if k in have}, "inputs": {n: batch for n in names}}


def pipeline_worker(rank: int, world: int, model_names, configs: list) -> list:
    """For each model and config (pp, submesh shape, layout), every schedule. Returns failure strings."""
    failures = []
    for model_name in ([model_names] if isinstance(model_names, str) else model_names):
        failures += _model_cases(rank, model_name, configs)
    return failures


def _model_cases(rank: int, model_name: str, configs: list) -> list:
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.executor import RankProgram
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes

    torch.set_num_threads(1)
    failures = []
    torch.manual_seed(0)
    model, inputs, target, loss_fn, prefixes = PIPELINE_BUILDERS[model_name]()
    mb = len(target) // MICROBATCHES
    t_trace = time.perf_counter()
    captured = capture(model, tuple(x[:mb] for x in inputs), loss_fn=loss_fn, target=target[:mb])
    if os.environ.get("AUTOSHARD_PP_TIMING") and rank == 0:
        print(f"{model_name}: trace {time.perf_counter() - t_trace:.2f}s", flush=True)
    batches = {MICROBATCHES: (inputs, target)}

    cases = []  # (pp, sub_shape, layout, schedule, virtual, m, plan key): a plan per key, shared by schedules
    for pp, sub_shape, layout in configs:
        for sched_name, virtual in SCHEDULES:
            m = microbatches_for(sched_name, pp)
            key = (pp, tuple(sub_shape), layout, pp * virtual, sched_name in ("zbv", "dualpipev"), m)
            cases.append((pp, sub_shape, layout, sched_name, virtual, m, key))
    first = {}  # plan key -> the first schedule that needs it (the one it is made for)
    for case in cases:
        first.setdefault(case[-1], case)

    def make(pp, sub_shape, layout, sched_name, virtual, m, key):
        nodes = stage_nodes_from_prefixes(captured, prefixes[pp * virtual])
        solve = lambda g, sm: plan_sharding(g.captured, sm, PlanContext.of("cpu", time_limit_s=10),  # noqa: E731
                                            pins=Pins(**stage_pins(layout, model_name, g.captured, sm)))
        return make_pipeline_plan(captured, nodes, Mesh.of((pp,) + tuple(sub_shape)), schedule=sched_name,
                                  microbatches=m, virtual=virtual, solve=solve).to_json()
    # each plan made once, the plans spread over the ranks (rank 0 alone made them all, one core idle)
    plans = dict(zip(first, spread_over_ranks([lambda c=c: make(*c) for c in first.values()])))

    for pp, sub_shape, layout, sched_name, virtual, m, key in cases:
        case = f"{model_name} pp={pp} sub={sub_shape} {layout} {sched_name}"
        if m not in batches:  # more microbatches of the traced size: a larger global batch
            batches[m] = (larger_batch(inputs, m // MICROBATCHES), larger_batch((target,), m // MICROBATCHES)[0])
        x, y = batches[m]
        plan = Plan.from_json({**plans[key].value(), "schedule": sched_name})
        schedule = generate(sched_name, pp, m, virtual=virtual)
        t_build = time.perf_counter()
        prog = RankProgram(plan.attach(captured), schedule=schedule, model=model)
        t_steps = time.perf_counter()
        ref = copy.deepcopy(model)
        failures += train_against_one_device(
            case, prog, ref, (x, y), loss_fn=loss_fn, steps=STEPS, tol=TOL, optimizer=adamw(lr=1e-3, eps=ADAM_EPS),
            check_gradients=lambda program, reference: pipeline_gradient_mismatches(case, program, reference, TOL))
        if layout == "dp":  # the gradient all-reduce starts inside the last BW / W, not after it
            late = [s for s, sync in prog._syncs.items() if sync.buckets and sync.overlapped == 0]
            if late:
                failures.append(f"{case}: stages {late} launched no gradient bucket during their last weight action")
        executed = [e.action for e in prog.timeline]
        planned = [str(a) for a in schedule[prog.group] if a.kind in ("F", "B", "W", "BW")]
        if executed != planned:
            failures.append(f"{case}: rank {rank} ran {executed}, the schedule says {planned}")
        if os.environ.get("AUTOSHARD_PP_TIMING") and rank == 0:
            print(f"{case}: build {t_steps - t_build:.2f}s, steps+checks {time.perf_counter() - t_steps:.2f}s",
                  flush=True)
        del prog
    return failures


CONFIGS_4 = [(4, (1,), "single"), (2, (2,), "dp"), (2, (2,), "tp")]
CONFIGS_8 = [(2, (2, 2), "tp")]


def test_pipeline_matches_single_device_4_ranks():
    """GPT and U-Net on pp=4, pp=2 x dp=2, pp=2 x tp=2 under every schedule (DualPipeV at pp=4 with 8
    microbatches). ``autoshard.compile(..., pp=...)`` is tested in test_pipeline_auto.py."""
    failures = failures_of(run_ranks(pipeline_worker, 4, ["gpt", "unet"], CONFIGS_4, timeout=600))
    assert not failures, "\n".join(failures)


@pytest.mark.slow  # 8 ranks; the 4-rank test covers every schedule in the fast tier
def test_pipeline_matches_single_device_8_ranks():
    failures = failures_of(run_ranks(pipeline_worker, 8, ["gpt", "unet"], CONFIGS_8, timeout=600))
    assert not failures, "\n".join(failures)


def test_split_and_bad_input():
    """Sub-graph wiring (a long skip goes straight to its consumer) and clear errors on bad stage cuts."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import PlanFormatError
    from autoshard.passes.pipeline.stages.stage_graphs import split_stages, stage_nodes_from_prefixes, stage_nodes_from_starts

    torch.manual_seed(0)
    model, inputs, target, loss_fn, prefixes = unet()
    captured = capture(model, tuple(x[:2] for x in inputs), loss_fn=loss_fn, target=target[:2])
    nodes = stage_nodes_from_prefixes(captured, prefixes[4])
    stages = split_stages(captured, nodes)
    assert [g.is_last for g in stages] == [False, False, False, True]
    # down.0's output is read by up.3 (stage 3) and sent there directly, not relayed by stages 1 and 2
    skip = next(name for name, consumers in stages[0].sends if 3 in consumers)
    assert (skip, 0) in stages[3].receives and all(skip not in dict(g.receives) for g in stages[1:3])
    assert stages[3].reads_target and not any(g.reads_target for g in stages[:3])
    calls = [n.name for n in captured.gm.graph.nodes if n.op == "call_function"]
    with pytest.raises(PlanFormatError, match="increasing graph order"):
        stage_nodes_from_starts(captured, [calls[5], calls[2]])
    with pytest.raises(PlanFormatError, match="no op of the captured graph comes from module"):
        stage_nodes_from_prefixes(captured, ["nope"])
    with pytest.raises(PlanFormatError, match="belong to no stage"):
        split_stages(captured, [nodes[0], nodes[1]])
    swapped = [nodes[1], nodes[0]] + nodes[2:]
    with pytest.raises(PlanFormatError, match="values must flow forward"):
        split_stages(captured, swapped)


def test_executed_schedule_is_checked():
    """The runtime executes the compute order (transfers follow the data); a bad order is caught."""
    from autoshard.passes.pipeline.schedule.actions import Action
    from autoshard.passes.pipeline.schedule.simulate import DeadlockError, check_deadlock
    from autoshard.runtime.pipeline.interpreter import executed_schedule

    from autoshard.passes.pipeline.schedule.generators import generate

    good = generate("1f1b", 2, 2)
    run = executed_schedule(good)
    assert [str(a) for a in run[1]] == ["1F0", "1BW0", "1F1", "1BW1"]
    check_deadlock(run, require_comms=False)
    bad = {0: [Action(0, "BW", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "BW", 0)]}
    with pytest.raises(DeadlockError):
        check_deadlock(executed_schedule(bad), require_comms=False)


def test_split_backward_matches_full_backward():
    """B then W (zero-bubble split) gives the same input and weight gradients as one backward, and W
    starts where B stopped (frontier edges and weight-only roots recorded, no weight gradient in B)."""
    from autoshard.runtime.pipeline.split_backward import SplitBackward

    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    scale = torch.nn.Parameter(torch.randn(3))
    params = list(lin1.parameters()) + list(lin2.parameters()) + [scale]
    x = torch.randn(4, 6, requires_grad=True)
    ids_only = torch.randn(4, 3)  # an output part that never reaches x: W's root

    def run():
        h = torch.nn.functional.gelu(lin1(x))
        return [lin2(h) * scale, ids_only * scale]

    seeds = [torch.randn(4, 3), torch.randn(4, 3)]
    outs = run()
    torch.autograd.backward(outs, seeds)
    want_x, want_p = x.grad.clone(), [p.grad.clone() for p in params]
    x.grad = None
    for p in params:
        p.grad = None
    split = SplitBackward(run(), seeds, [x], params)
    (got_x,) = split.input_grads()
    assert all(p.grad is None for p in params) and split.frontier and split.roots
    split.weight_grads()
    assert torch.allclose(got_x, want_x, atol=1e-6)
    for p, w in zip(params, want_p):
        assert torch.allclose(p.grad, w, atol=1e-6)
