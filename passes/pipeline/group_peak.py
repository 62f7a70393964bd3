"""A rank group's memory peak when it holds several pipeline stages (virtual stages).

A rank runs one of its stages at a time. Each stage's memory is split into a record (four numbers in
its ``Solution.estimated``, ``STAGE_MEMORY_KEYS``):

- ``stage_idle_bytes``: what the stage keeps whatever runs: its parameters, gradients, optimizer
  state, gradient buckets, point-to-point buffers;
- ``stage_microbatch_bytes``: what it keeps per microbatch it holds (saved activations; a recomputing
  stage: its received inputs);
- ``stage_running_bytes``: what running adds: the working set of the op that runs now, the gradients
  one backward makes before they are added in;
- ``stage_optimizer_bytes``: its peak during the optimizer step.

The group's peak is the larger of the optimizer step's (the stages' optimizer peaks summed: a foreach
AdamW makes its temporaries for every parameter of the rank at once) and the peak over the
schedule's moments (``schedule.held_moments``: which stage runs, how many microbatches each holds)
of every stage's idle bytes and held microbatches plus the running stage's working set. Summing the
stages' own whole-step peaks instead counts one working set per stage (v where only one runs) and
each stage at its own worst count, which the stages do not reach at the same moment.

With one stage per group it is that stage's own peak (``stage_peak``). Stages without a record (a
solution planned another way, an older plan file) are summed as before: the safe side.
"""
from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["STAGE_MEMORY_KEYS", "memory_record", "group_peaks"]

STAGE_MEMORY_KEYS = ("stage_idle_bytes", "stage_microbatch_bytes", "stage_running_bytes", "stage_optimizer_bytes")


def memory_record(idle: float, per_microbatch: float, running: float, optimizer: float) -> dict:
    """The four record entries (module docstring) as ``Solution.estimated`` keys."""
    return dict(zip(STAGE_MEMORY_KEYS, (float(idle), float(per_microbatch), max(0.0, float(running)),
                                        float(optimizer))))


def group_peaks(stages: Iterable[tuple[int, int, Optional[dict], float]], schedule: str, pp: int,
                microbatches: int) -> dict[int, float]:
    """Per rank group, its peak bytes per device. ``stages``: (stage index, group, the stage solution's
    ``estimated`` (None: no solution), its ``estimated_memory``) for every stage; ``schedule`` run on
    ``pp`` groups over ``microbatches``."""
    stages = list(stages)
    summed: dict[int, float] = {}
    for _, group, est, memory in stages:
        if est is not None:
            summed[group] = summed.get(group, 0.0) + float(memory)
    records = {index: est for index, _, est, _ in stages if est is not None}
    if len(stages) <= pp or not records or any(not all(k in est for k in STAGE_MEMORY_KEYS)
                                               for est in records.values()):
        return summed
    from autoshard.passes.pipeline.schedule.held_moments import held_moments
    try:
        moments = held_moments(schedule, pp, microbatches)
    except ValueError:
        return summed
    out: dict[int, float] = {}
    for group in summed:
        mine = [(index, est) for index, g, est, _ in stages if g == group and est is not None]
        idle = sum(est["stage_idle_bytes"] for _, est in mine)
        optimizer = sum(est["stage_optimizer_bytes"] for _, est in mine)
        running = idle
        for stage, counts in moments[group]:
            held = sum(k * records[s]["stage_microbatch_bytes"] for s, k in counts if s in records)
            now = records[stage]["stage_running_bytes"] if stage in records else 0.0
            running = max(running, idle + held + now)
        out[group] = max(running, optimizer)
    return out
