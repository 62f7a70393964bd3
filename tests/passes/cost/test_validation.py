"""The error band the summary prints is the one benchmarks/literature.py computes today."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from autoshard.passes.cost.validation import LITERATURE_RESIDUALS, error_band_line

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _literature():
    spec = importlib.util.spec_from_file_location("literature", ROOT / "benchmarks" / "literature.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_recorded_residuals_match_the_benchmark():
    lit = _literature()
    got = {r.name: lit.predicted(r, lit.step_time(r)["step"]) / r.measured - 1 for r in lit.RUNS}
    assert set(got) == set(LITERATURE_RESIDUALS)
    for name, err in got.items():
        assert err == pytest.approx(LITERATURE_RESIDUALS[name], abs=0.0015), name


def test_band_line_names_the_extremes():
    line = error_band_line()
    errs = sorted(LITERATURE_RESIDUALS.values())
    assert f"{100 * errs[0]:+.0f}%" in line and f"{100 * errs[-1]:+.0f}%" in line and "13 published runs" in line
