"""Measured pipeline timelines from every rank: gathered as JSON, drawn like the simulator's.

``gather_timelines(events)`` is a collective (call it on every rank after a step): each rank's
``TimelineEvent`` list travels as JSON bytes (no pickle), and every rank gets ``{rank: events}`` keyed
by the sender's rank in the process group (an event's own ``rank`` field is its pipeline group).
``draw_measured_timeline(timelines, path)`` draws them with the simulator's SVG writer: ranks as
rows, F/B/W/BW boxes coloured by microbatch at their measured wall-clock times, the step time and
bubble fraction (idle share of ranks x step) measured too. ``write_chrome_trace(timelines, path)``
writes them as Chrome trace JSON.
"""
from __future__ import annotations

import json
import re

import torch
import torch.distributed as dist

from autoshard.passes.pipeline.schedule.actions import Action
from autoshard.passes.pipeline.schedule.simulate import SimResult
from autoshard.passes.pipeline.schedule.timeline import chrome_trace, draw_timeline

from .interpreter import TimelineEvent

__all__ = ["gather_timelines", "measured_result", "draw_measured_timeline", "write_chrome_trace"]

_LABEL = re.compile(r"^(\d+)(F|BW|B|W)(\d+)$")


def gather_timelines(events: list[TimelineEvent], group=None) -> dict[int, list[TimelineEvent]]:
    """Every rank's events, on every rank, keyed by sender rank (a collective over ``group``, default the
    world)."""
    mine = json.dumps([[e.rank, e.action, e.start, e.end, e.wait] for e in events]).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(mine)], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    out = {}
    for sender, (b, s) in enumerate(zip(bufs, sizes)):
        rows = json.loads(bytes(b[:int(s.item())].tolist()).decode())
        out[sender] = [TimelineEvent(int(r), action, float(start), float(end), float(wait))
                       for r, action, start, end, wait in rows]
    return out


def measured_result(timelines: dict[int, list[TimelineEvent]]) -> SimResult:
    """The measured step as a ``SimResult`` (events, step time, busy time and bubble per rank); peak
    memory is not measured (``peak_*`` are empty)."""
    events, busy = [], {}
    for rank, evs in sorted(timelines.items()):
        for e in evs:
            m = _LABEL.match(e.action)
            if m is None:
                raise ValueError(f"timeline event {e.action!r} is not a compute action label like '0F3'")
            events.append((rank, Action(int(m.group(1)), m.group(2), int(m.group(3))), e.start, e.end))
            busy[rank] = busy.get(rank, 0.0) + (e.end - e.start)
    if not events:
        return SimResult(0.0, [], 0.0, [], [], [])
    t0 = min(s for _, _, s, _ in events)
    events = [(r, a, s - t0, e - t0) for r, a, s, e in events]
    step = max(e for *_, e in events)
    ranks = sorted(timelines)
    used = [busy.get(r, 0.0) for r in ranks]
    return SimResult(step, used, 1.0 - sum(used) / (len(ranks) * step) if step > 0 else 0.0, [], [], events)


def draw_measured_timeline(timelines: dict[int, list[TimelineEvent]], path, title: str = "measured step") -> str:
    """SVG of the measured step (``measured_result``) with the simulator's drawing; returns the path."""
    return draw_timeline(measured_result(timelines), path, title=title)


def write_chrome_trace(timelines: dict[int, list[TimelineEvent]], path) -> str:
    """Write measured timelines (rank -> events, e.g. gathered from every rank's ``timeline``) as Chrome
    trace JSON (``chrome://tracing`` / Perfetto; one row per rank) with the simulator's writer."""
    events = [(int(r), e.action, e.start, e.end, _microbatch(e.action)) for r, evs in sorted(timelines.items())
              for e in evs]
    return chrome_trace(events, path)


def _microbatch(label: str) -> int:
    digits = ""
    for ch in reversed(label):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits or 0)
