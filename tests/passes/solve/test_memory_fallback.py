"""A binding memory limit must not end in the smallest-memory plan while a fast plan fits (issue 31).

The MLP of ``benchmarks/memory_limit_plan_time.py`` on (2, 2) under 55% of its free plan's memory: the
ILP's answers were ZeRO-1 plans under accumulation whose held unreduced gradients (priced by the step
walk, left out of the ILP's bytes) and reduce-scatter buckets put their peak near twice the limit, and
the peak retry gave up, so the planner fell back to the smallest-memory plan (13x the free step),
although FSDP over both axes without accumulation fits at 1.3x. Meta tensors: nothing is allocated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import DeepMLP


def test_limited_plan_finds_a_fast_plan_that_fits_instead_of_the_smallest():
    with torch.device("meta"):
        model = DeepMLP()
    x, y = torch.empty(8, 16, 64, device="meta"), torch.empty(8, 16, 64, device="meta")
    kw = dict(example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="h100")
    free = autoshard.plan(model, (2, 2), **kw)
    limit = int(0.55 * free.estimated_memory)
    # a fast plan fits: every parameter sharded over both axes, one microstep, priced without a limit
    fsdp = autoshard.plan(model, (2, 2), params={"*": ("S(0)", "S(0)")}, accumulation=1, **kw)
    assert fsdp.estimated_memory <= limit
    assert fsdp.estimated_step_time <= 2 * free.estimated_step_time
    limited = autoshard.plan(model, (2, 2), memory_limit=limit, **kw)
    assert limited.solution.solver_stats["status"] != "MEMORY_FALLBACK"
    assert limited.estimated_memory <= limit
    assert limited.estimated_step_time <= 2 * free.estimated_step_time
