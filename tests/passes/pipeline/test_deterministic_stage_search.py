"""The stage planner gives the same pipeline plan however busy the machine is (issue 17, item 6 for
pipelines): its refinement loops are bounded by deterministic work (CP-SAT deterministic seconds,
``WorkBudget``), never by the clock.

Two checks on a small GPT whose slow network makes a pipeline pay: a clock that jumps an hour at
every reading (what an infinitely loaded machine looks like to a wall-clock deadline) changes
nothing, and a plan made while two busy-loop processes compete for the CPU equals the quiet one.
The search statistics that a deadline would cut (stage ILPs run, even cuts simulated, work spent)
are compared too, not only the answer."""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.testing.models import GPT, lm_loss
from autoshard.testing.cpu_load import busy_cores
from autoshard.passes.solve.context import PlanContext

# one device per node on a slow inter-node link: the gradient all-reduce is dear, so stages pay
SLOW_LINKS = dataclasses.replace(PRESETS["h100"], name="h100-slow-links", sm_count=0, min_kernel_s=0.0,
                                 collective_model="analytic", comm_streams=0, devices_per_node=1,
                                 inter_node_bandwidth=1e9, inter_node_latency=1e-4)


def _captured():
    with torch.device("meta"):
        model = GPT(2048, 256, 8, 4, 128, False)
    ids = torch.empty(32, 128, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


def _planned(captured, monkeypatch) -> tuple:
    """The plan's decisions, and the statistics of its stage search that a deadline would cut."""
    import autoshard.passes.pipeline.stages.planner as planner
    seen = {}
    real = planner.search_stages

    def recording(*args, **kwargs):
        best, stats = real(*args, **kwargs)
        seen.update(stats)
        return best, stats

    monkeypatch.setattr(planner, "search_stages", recording)
    plan = plan_pipeline(captured, (8,), PlanContext.of(SLOW_LINKS, time_limit_s=2.0))
    monkeypatch.setattr(planner, "search_stages", real)
    counted = {k: seen.get(k) for k in ("configs", "simulated", "ilp", "even", "timed_out", "work_s")}
    return (plan.pp, plan.schedule, plan.microbatches, round(plan.estimated_step_time, 12),
            [(s.nodes[0], len(s.nodes), s.group, tuple(s.mesh.shape), s.recompute) for s in plan.stages], counted)


def test_a_clock_that_races_changes_nothing(monkeypatch):
    captured = _captured()
    quiet = _planned(captured, monkeypatch)
    assert quiet[0] > 1, "the premise: the slow network makes a pipeline pay"
    assert quiet[-1]["ilp"] >= 1 and not quiet[-1]["timed_out"]
    ticks = itertools.count()
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + 3600.0 * next(ticks))
    assert _planned(captured, monkeypatch) == quiet


def test_same_pipeline_plan_under_cpu_load(monkeypatch):
    captured = _captured()
    quiet = _planned(captured, monkeypatch)
    with busy_cores(2):
        loaded = _planned(captured, monkeypatch)
    assert loaded == quiet
