"""autoshard/testing/svg_plot.py, the benchmarks' plot writer: the SVG is well-formed XML and each point
lands where the axes say."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from autoshard.testing.svg_plot import PlotBox, line_plot, nice_ticks, plot_geometry

NS = "{http://www.w3.org/2000/svg}"


def test_svg_is_xml_with_one_line_per_series_and_a_legend():
    series = {"125M": [(64, 0.9), (8, 0.5), (1024, 3.0)], "6.7B <big> & co": [(8, 1.0), (1024, 4.0)]}
    root = ET.fromstring(line_plot(series, x_label="devices", y_label="solve s", log_x=True, title="plan time"))
    assert root.tag == f"{NS}svg"
    lines = root.findall(f"{NS}polyline")
    assert [pl.get("data-series") for pl in lines] == list(series)
    assert len(root.findall(f"{NS}circle")) == 5
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "plan time" in texts and "devices" in texts and "solve s" in texts
    assert "6.7B <big> & co" in texts  # escaped in the file, intact once parsed
    assert {"8", "64", "1024"} <= set(texts)  # log-2 ticks for device counts


def test_points_are_placed_on_the_log_x_and_linear_y_scales():
    box = PlotBox(width=500, height=300, left=50, right=50, top=20, bottom=30)  # area x 50..450, y 270..20
    series = {"a": [(8, 0.0), (64, 1.0), (1024, 2.0)]}
    geo = plot_geometry(series, log_x=True, box=box)
    assert [t for t, _ in geo["x_ticks"]][0] == 8 and [t for t, _ in geo["x_ticks"]][-1] == 1024
    (p8, p64, p1024), = geo["points"].values()
    assert p8[0] == pytest.approx(50) and p1024[0] == pytest.approx(450)
    assert p64[0] == pytest.approx(50 + 400 * 3 / 7)  # log2: 8 -> 64 is 3 of the 7 doublings to 1024
    y_top = geo["y_ticks"][-1][0]
    assert p8[1] == pytest.approx(270)  # y = 0 at the bottom edge
    assert p64[1] == pytest.approx(270 - 250 * 1.0 / y_top)
    # the same positions are written into the SVG
    root = ET.fromstring(line_plot(series, log_x=True, box=box))
    circles = [(float(c.get("cx")), float(c.get("cy"))) for c in root.findall(f"{NS}circle")]
    assert circles == [pytest.approx(p, abs=0.01) for p in (p8, p64, p1024)]
    poly = root.find(f"{NS}polyline").get("points").split()
    assert [tuple(float(v) for v in xy.split(",")) for xy in poly] == [pytest.approx(c) for c in circles]


def test_ticks_and_unplottable_points():
    assert nice_ticks(8, 1024, log=True) == [2.0 ** k for k in range(3, 11)]
    assert nice_ticks(0.01, 100, log=True) == [10.0 ** k for k in range(-2, 3)]
    assert nice_ticks(0.0, 7.0, log=False) == [0, 1, 2, 3, 4, 5, 6, 7]
    geo = plot_geometry({"a": [(1, 2.0), (0, 3.0), (10, math.nan)]}, log_x=True)
    assert len(geo["points"]["a"]) == 1  # x = 0 cannot sit on a log axis; NaN is skipped
