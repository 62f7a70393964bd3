"""A 2-stage pipeline's whole-step peak, measured by torch's ``MemTracker`` on each stage rank, against
the stage's estimate (issue 21, item 2).

GPT (4 blocks, vocab 256, d 32) cut before ``blocks.2`` on 2 gloo ranks, 1F1B, 4 microbatches of 4;
each stage planned by ``plan_sharding`` on its submesh (``make_pipeline_plan``). Around the second
step plus AdamW's step, ``MicrostepTracker`` tracks the rank's parameters, gradients and optimizer
state (``runtime.local_module`` over the ``PipelineProgram``). Goal, as for one program
(``tests/runtime/test_memory_peak.py``): the stage's estimate (``passes.pipeline.stages.stage_peak``:
one microbatch's walk of the stage's plan, plus the schedule's other in-flight microbatches' saved
activations, the accumulated gradients and one microbatch's p2p buffers) within 10% of the measure
and never more than 5% under it. Stage 0 (priced as trained, its output's gradient received) meets it
(-0.3%), and so does the last stage (-1.9%, 2026-11-27) since the step walk counts cross entropy's
backward intermediate (``passes.capture.backward_workspace``) and ``MicrostepTracker`` no longer holds
every parameter gradient twice (``autoshard.testing.tracker_hooks``); it was -12.6% (1,068,688 B
measured against 934,004), and before the stage peak stage 0 was -63%, stage 1 -26%. The runtime still
keeps every sent tensor to the step's end and posts all receives early (``runtime/pipeline/p2p.py``),
which the stage peak counts once: what is left of the miss.

Interleaved 1F1B (v = 2: 4 stages cut before ``blocks.1``, ``blocks.2``, ``blocks.3``, two per rank):
each rank's peak against its group's estimate (``Plan.estimated_memory`` per group,
``passes.pipeline.group_peak``). Summing the two stages' own whole-step peaks, as the plan did, was
+12.5% (rank 0) and +17.7% (rank 1) over the measure (2026-11-29): one working set per stage, each
stage at its own worst count. The group peak over the schedule's moments counted the p2p buffers once
and was -2.7% / -6.2%; with the runtime's sends held to the step's end it is +4.6% / +1.7%.
MemTracker raised KeyError here before ``MicrostepTracker`` cleared only the re-called stage
program's statistics (``autoshard.testing.memory_estimates``).
"""
from __future__ import annotations

import pytest
import torch

from autoshard.testing.ranks import run_ranks
from autoshard.passes.solve.context import PlanContext

SCHEDULE, MICROBATCHES = "1f1b", 4


def peak_worker(rank: int, world: int, schedule: str = SCHEDULE, cuts: tuple = ("blocks.2",), virtual: int = 1) -> tuple:
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.local_module import local_module
    from autoshard.runtime.executor import RankProgram
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    from autoshard.testing.memory_estimates import MicrostepTracker
    from autoshard.testing.models import gpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _, _, loss_fn = gpt(vocab=256, d=32, n_layer=4, n_head=4, seq=16)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (16, 16), generator=g), torch.randint(0, 256, (16, 16), generator=g)
    mb = len(y) // MICROBATCHES
    captured = capture(model, (x[:mb],), loss_fn=loss_fn, target=y[:mb])
    payload = None
    if rank == 0:
        nodes = stage_nodes_from_prefixes(captured, list(cuts))
        plan = make_pipeline_plan(captured, nodes, (2,), schedule=schedule, microbatches=MICROBATCHES, virtual=virtual,
                                  solve=lambda sg, sm: plan_sharding(sg.captured, sm,
                                                                     PlanContext.of("cpu", time_limit_s=10)))
        payload = plan.to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0))
    program = RankProgram(plan.attach(captured), schedule=generate(schedule, 2, MICROBATCHES), model=model)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    program.step(x, target=y)  # the first step creates the optimizer state
    optimizer.step()
    optimizer.zero_grad()
    tracker = MicrostepTracker()
    tracker.track_external(local_module(program), optimizer)
    with tracker:
        program.step(x, target=y)
        optimizer.step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    state = {"params": sum(p.numel() * p.element_size() for p in program.parameters()),
             "Parameter": peak["Parameter"], "Optstate": peak["Optstate"]}
    if virtual > 1:  # the rank group's peak, and each of its stages' own whole-step peaks summed
        mine = [s.solution.estimated_memory for s in plan.stages if s.group == rank]
        return rank, peak["Total"], plan._group_memory()[rank], sum(mine), state
    solution = plan.stages[rank].solution
    return rank, peak["Total"], solution.estimated_memory, solution.memory_peak_phase, state


@pytest.fixture(scope="module")
def stage_peaks() -> list:
    return run_ranks(peak_worker, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_each_stage_estimate_is_within_ten_percent_and_never_five_percent_under(stage_peaks, stage):
    rank, measured, estimated, phase, _ = stage_peaks[stage]
    gap = (estimated - measured) / measured
    assert -0.05 <= gap <= 0.10, f"stage {rank}: measured {measured} vs estimated {estimated:.0f} ({gap:+.1%}, {phase})"


@pytest.mark.slow
def test_memtracker_tracks_a_pipeline_programs_state(stage_peaks):
    """``local_module`` over a ``PipelineProgram`` (its parameters and buffers): MemTracker sees a
    stage rank's parameters and AdamW's two states, which exist before the tracked step."""
    assert len(stage_peaks) == 2
    for rank, measured, estimated, phase, state in stage_peaks:
        assert state["params"] > 0 and state["Parameter"] == state["params"], (rank, state)
        assert state["Optstate"] >= 2 * state["params"], (rank, state)
        assert measured >= 4 * state["params"] and estimated > 0 and phase  # + gradients, + activations


@pytest.fixture(scope="module")
def interleaved_peaks() -> list:
    return run_ranks(peak_worker, 2, "interleaved-1f1b", ("blocks.1", "blocks.2", "blocks.3"), 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_interleaved_group_estimate_is_within_ten_percent_and_never_five_percent_under(interleaved_peaks, rank):
    """A rank running two stages of interleaved 1F1B: its group's estimate against the measured peak;
    the stages' own peaks summed (what the group was priced at before) overshoot it by more than 10%."""
    got, measured, estimated, summed, _ = interleaved_peaks[rank]
    gap = (estimated - measured) / measured
    assert -0.05 <= gap <= 0.10, f"rank {got}: measured {measured} vs group estimate {estimated:.0f} ({gap:+.1%})"
    assert summed > 1.10 * measured, f"rank {got}: the stages' peaks summed ({summed:.0f}) no longer overshoot {measured}"
