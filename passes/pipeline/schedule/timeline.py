"""Pictures of a pipeline step: an SVG timeline and Chrome trace JSON.

``draw_timeline(sim_result, path)`` draws ranks as rows and every compute action as a box at its
simulated start/end, coloured by microbatch (hue) and kind (F light, B medium, W dark, BW between),
labelled ``F3``/``B3``/``W3``/``BW3`` (``7F3`` with the stage when a rank owns several stages) and
with stage and times in the hover title.

``chrome_trace(events, path)`` writes ``{"traceEvents": [...]}`` with one complete event (ph "X")
per ``(rank, label, start_s, end_s, microbatch)``: pid and tid are the rank, ts/dur in microseconds,
so chrome://tracing and Perfetto show one row per rank. The runtime uses the same writer for
measured timelines; ``SimResult.trace_events()`` gives the simulated ones (simulator time units
are read as seconds).

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "t.json")
>>> _ = chrome_trace([(0, "0F0", 0.0, 0.001, 0), (1, "1F0", 0.001, 0.002, 0)], path)
>>> [(e["pid"], e["ts"], e["dur"]) for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
[(0, 0.0, 1000.0), (1, 1000.0, 1000.0)]
"""
from __future__ import annotations

import colorsys
import json
import os
import re
from typing import Iterable, Optional, Union
from xml.sax.saxutils import escape

from autoshard.passes.pipeline.schedule.simulate import ScheduleError, SimResult

PathLike = Union[str, os.PathLike]
_LIGHTNESS = {"F": 0.78, "B": 0.58, "W": 0.40, "BW": 0.50}


def _colour(microbatch: int, kind: str) -> str:
    hue = (microbatch * 0.618033988749895) % 1.0  # golden-ratio steps keep neighbours apart
    r, g, b = colorsys.hls_to_rgb(hue, _LIGHTNESS.get(kind, 0.6), 0.65)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def draw_timeline(sim_result: SimResult, path: PathLike, *, width: int = 1200, row_height: int = 28,
                  title: Optional[str] = None) -> str:
    """Write an SVG timeline of ``sim_result`` to ``path`` and return the path."""
    compute = [(r, a, s, e) for r, a, s, e in sim_result.events if a.kind in _LIGHTNESS]
    ranks = sorted({r for r, *_ in sim_result.events}) or [0]
    span = sim_result.step_time or 1.0
    left, top = 70, 40 if title is None else 60
    scale = (width - left - 10) / span
    height = top + row_height * len(ranks) + 40
    row_of = {r: i for i, r in enumerate(ranks)}
    stages_of: dict[int, set] = {}
    for r, a, _, _ in compute:
        stages_of.setdefault(r, set()).add(a.stage)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    if title is not None:
        out.append(f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>')
    out.append(f'<text x="{left}" y="{top - 12}">step {sim_result.step_time:g}, bubble '
               f'{sim_result.bubble_fraction:.1%}</text>')
    for r in ranks:
        y = top + row_of[r] * row_height
        out.append(f'<text x="6" y="{y + row_height * 0.65:.1f}">rank {r}</text>')
        out.append(f'<line x1="{left}" y1="{y + row_height}" x2="{width - 10}" y2="{y + row_height}" '
                   f'stroke="#ddd"/>')
    for r, a, s, e in compute:
        x, w = left + s * scale, max((e - s) * scale, 0.5)
        y = top + row_of[r] * row_height + 2
        label = f"{a.stage if len(stages_of[r]) > 1 else ''}{a.kind}{a.microbatch}"
        out.append(f'<g><title>stage {a.stage} {a.kind} microbatch {a.microbatch}: {s:g}..{e:g}</title>'
                   f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_height - 4}" '
                   f'fill="{_colour(a.microbatch, a.kind)}" stroke="#333" stroke-width="0.5"/>')
        if w >= 7 * len(label):
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + row_height * 0.6:.1f}" text-anchor="middle">'
                       f'{escape(label)}</text>')
        out.append('</g>')
    axis_y = top + row_height * len(ranks) + 16
    for k in range(11):
        t = span * k / 10
        out.append(f'<text x="{left + t * scale:.1f}" y="{axis_y}" text-anchor="middle">{t:g}</text>')
    out.append('</svg>')
    with open(path, "w") as fh:
        fh.write("\n".join(out))
    return str(path)


def _category(label: str) -> str:
    """``"2BW3"`` -> ``"BW"``: the action kind, so Perfetto can filter by it; else ``"op"``."""
    m = re.match(r"\d*([A-Z_]+)", label)
    return m.group(1) if m else "op"


def chrome_trace(events: Iterable[tuple], path: PathLike) -> str:
    """Write Chrome trace JSON for ``(rank, label, start_s, end_s, microbatch)`` events; return the path.

    ``microbatch`` may be None (e.g. an optimizer step). Raises ScheduleError on an event ending
    before it starts.
    """
    trace, ranks = [], set()
    for ev in events:
        if len(ev) != 5:
            raise ScheduleError(f"trace event {ev!r} must be (rank, label, start_s, end_s, microbatch)")
        rank, label, start, end, mb = ev
        if end < start:
            raise ScheduleError(f"trace event {label!r} on rank {rank} ends at {end} before it starts at {start}")
        ranks.add(int(rank))
        trace.append({"name": str(label), "ph": "X", "pid": int(rank), "tid": int(rank),
                      "ts": float(start) * 1e6, "dur": (float(end) - float(start)) * 1e6,
                      "cat": _category(str(label)),
                      "args": {"microbatch": mb}})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "tid": r, "args": {"name": f"rank {r}"}}
            for r in sorted(ranks)]
    with open(path, "w") as fh:
        json.dump({"traceEvents": meta + trace, "displayTimeUnit": "ms"}, fh)
    return str(path)
