"""A small dependency-free SVG line plot: axes, linear or log-scale x and y, ticks, a legend, one
polyline (with point markers) per series. For benchmark figures where matplotlib is not installed.

>>> svg = line_plot({"125M": [(8, 0.5), (64, 0.9)], "1.3B": [(8, 0.7), (64, 1.4)]},
...                 x_label="devices", y_label="solve s", log_x=True, title="plan time")
>>> svg.startswith("<svg") and svg.count("<polyline") == 2
True

``plot_geometry`` returns where each data point lands (pixel coordinates), which the tests check.
Non-finite or (on a log axis) non-positive points are left out of their line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence
from xml.sax.saxutils import escape

__all__ = ["PlotBox", "line_plot", "plot_geometry", "nice_ticks", "write_svg"]

#: line colours (the ColorBrewer "Set1"/"Dark2" family: distinguishable, print well)
COLORS = ("#e41a1c", "#377eb8", "#4daf4a", "#984ea3", "#ff7f00", "#a65628", "#f781bf", "#666666",
          "#1b9e77", "#d95f02")


@dataclass(frozen=True)
class PlotBox:
    """Pixel layout: the whole picture is ``width x height``; the plotting area is inset by the margins."""
    width: int = 640
    height: int = 400
    left: int = 70
    right: int = 150
    top: int = 40
    bottom: int = 50

    @property
    def x0(self) -> float:
        return float(self.left)

    @property
    def x1(self) -> float:
        return float(self.width - self.right)

    @property
    def y0(self) -> float:  # bottom of the plotting area (pixel y grows downwards)
        return float(self.height - self.bottom)

    @property
    def y1(self) -> float:
        return float(self.top)


def _usable(v: float, log: bool) -> bool:
    return math.isfinite(v) and (v > 0 or not log)


def nice_ticks(lo: float, hi: float, log: bool, most: int = 8) -> list[float]:
    """Tick values covering [lo, hi]: powers of 2 on a log axis spanning under 3 decades from >= 1
    (device counts), else powers of 10; 1/2/5 x 10^k steps on a linear one.

    >>> nice_ticks(8, 1024, log=True)
    [8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]
    >>> nice_ticks(0.3, 2.2, log=False)
    [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    """
    if log:
        if hi <= 0:
            return [1.0]
        lo = max(lo, hi * 1e-12)
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        if math.log10(hi / lo) < 3 and lo >= 1:
            a2, b2 = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
            step = max(1, math.ceil((b2 - a2 + 1) / most))
            return [2.0 ** k for k in range(a2, b2 + 1, step)]
        step = max(1, math.ceil((b - a + 1) / most))
        return [10.0 ** k for k in range(a, b + 1, step)]
    if hi == lo:
        lo, hi = lo - 1.0, hi + 1.0
    raw = (hi - lo) / max(1, most - 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, k = [], 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 12))
        k += 1
    if ticks[-1] < hi:
        ticks.append(round(first + k * step, 12))
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


class _Scale:
    def __init__(self, lo: float, hi: float, p0: float, p1: float, log: bool):
        self.log, self.p0, self.p1 = log, p0, p1
        f = math.log10 if log else (lambda v: v)
        self.lo, self.hi = f(lo), f(hi)
        if self.hi == self.lo:
            self.lo, self.hi = self.lo - 0.5, self.hi + 0.5

    def __call__(self, v: float) -> float:
        t = ((math.log10(v) if self.log else v) - self.lo) / (self.hi - self.lo)
        return self.p0 + t * (self.p1 - self.p0)


def plot_geometry(series: Mapping[str, Sequence[tuple[float, float]]], *, log_x: bool = False,
                  log_y: bool = False, box: PlotBox = PlotBox()) -> dict:
    """Ticks and pixel positions: {"x_ticks": [(value, px)], "y_ticks": [(value, py)],
    "points": {name: [(px, py), ...]}}. The axes span the outermost ticks around the data."""
    xs = [x for pts in series.values() for x, y in pts if _usable(x, log_x) and _usable(y, log_y)]
    ys = [y for pts in series.values() for x, y in pts if _usable(x, log_x) and _usable(y, log_y)]
    if not xs:
        xs, ys = [1.0], [1.0]
    xt = nice_ticks(min(xs), max(xs), log_x)
    yt = nice_ticks(min(ys), max(ys), log_y)
    if not log_y and min(ys) >= 0 and yt[0] > 0:
        yt = [0.0] + yt  # a linear y axis of positive figures starts at 0
    sx = _Scale(min(xt[0], min(xs)), max(xt[-1], max(xs)), box.x0, box.x1, log_x)
    sy = _Scale(min(yt[0], min(ys)), max(yt[-1], max(ys)), box.y0, box.y1, log_y)
    points = {name: [(sx(x), sy(y)) for x, y in pts if _usable(x, log_x) and _usable(y, log_y)]
              for name, pts in series.items()}
    return {"x_ticks": [(t, sx(t)) for t in xt], "y_ticks": [(t, sy(t)) for t in yt], "points": points}


def line_plot(series: Mapping[str, Sequence[tuple[float, float]]], *, x_label: str = "", y_label: str = "",
              title: str = "", log_x: bool = False, log_y: bool = False, box: PlotBox = PlotBox()) -> str:
    """The SVG text of a line plot with one line per series (``name -> [(x, y), ...]``, drawn in
    the order given, points sorted by x)."""
    series = {name: sorted(pts) for name, pts in series.items()}
    geo = plot_geometry(series, log_x=log_x, log_y=log_y, box=box)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{box.width}" height="{box.height}" '
           f'viewBox="0 0 {box.width} {box.height}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{box.width}" height="{box.height}" fill="white"/>']
    if title:
        out.append(f'<text x="{(box.x0 + box.x1) / 2:.1f}" y="{box.top / 2 + 5:.1f}" text-anchor="middle" '
                   f'font-size="13">{escape(title)}</text>')
    for value, px in geo["x_ticks"]:
        out.append(f'<line x1="{px:.2f}" y1="{box.y1:.2f}" x2="{px:.2f}" y2="{box.y0:.2f}" stroke="#e5e5e5"/>')
        out.append(f'<line x1="{px:.2f}" y1="{box.y0:.2f}" x2="{px:.2f}" y2="{box.y0 + 5:.2f}" stroke="black"/>')
        out.append(f'<text x="{px:.2f}" y="{box.y0 + 18:.2f}" text-anchor="middle">{escape(_fmt(value))}</text>')
    for value, py in geo["y_ticks"]:
        out.append(f'<line x1="{box.x0:.2f}" y1="{py:.2f}" x2="{box.x1:.2f}" y2="{py:.2f}" stroke="#e5e5e5"/>')
        out.append(f'<line x1="{box.x0 - 5:.2f}" y1="{py:.2f}" x2="{box.x0:.2f}" y2="{py:.2f}" stroke="black"/>')
        out.append(f'<text x="{box.x0 - 8:.2f}" y="{py + 4:.2f}" text-anchor="end">{escape(_fmt(value))}</text>')
    out.append(f'<rect x="{box.x0:.2f}" y="{box.y1:.2f}" width="{box.x1 - box.x0:.2f}" '
               f'height="{box.y0 - box.y1:.2f}" fill="none" stroke="black"/>')
    if x_label:
        out.append(f'<text x="{(box.x0 + box.x1) / 2:.1f}" y="{box.height - 12}" text-anchor="middle">'
                   f'{escape(x_label)}</text>')
    if y_label:
        cy = (box.y0 + box.y1) / 2
        out.append(f'<text x="16" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 16 {cy:.1f})">'
                   f'{escape(y_label)}</text>')
    for k, (name, pts) in enumerate(geo["points"].items()):
        color = COLORS[k % len(COLORS)]
        label = escape(str(name), {'"': "&quot;"})
        if len(pts) > 1:
            coords = " ".join(f"{x:.2f},{y:.2f}" for x, y in pts)
            out.append(f'<polyline data-series="{label}" points="{coords}" fill="none" stroke="{color}" '
                       f'stroke-width="1.8"/>')
        for x, y in pts:
            out.append(f'<circle data-series="{label}" cx="{x:.2f}" cy="{y:.2f}" r="3" fill="{color}"/>')
        ly = box.y1 + 8 + 16 * k
        out.append(f'<line x1="{box.x1 + 12:.2f}" y1="{ly:.2f}" x2="{box.x1 + 32:.2f}" y2="{ly:.2f}" '
                   f'stroke="{color}" stroke-width="1.8"/>')
        out.append(f'<text x="{box.x1 + 38:.2f}" y="{ly + 4:.2f}">{escape(str(name))}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(path: str, series: Mapping[str, Sequence[tuple[float, float]]], **kwargs) -> Optional[str]:
    """Write ``line_plot(series, **kwargs)`` to ``path``; returns the path."""
    with open(path, "w") as f:
        f.write(line_plot(series, **kwargs))
    return path
