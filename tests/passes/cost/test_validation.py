"""The error band the summary prints is the one benchmarks/literature.py computes today."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from autoshard.passes.cost.validation import LITERATURE_RESIDUALS, error_band_line

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _literature():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("literature", ROOT / "benchmarks" / "literature.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_recorded_residuals_name_the_benchmarks_rows():
    lit = _literature()
    assert set(LITERATURE_RESIDUALS) == {r.name for r in lit.ROWS}


@pytest.mark.slow
def test_recorded_residual_matches_the_benchmark():
    """One row repriced through autoshard.plan(layout=) (the fastest: 24 blocks, no pipeline)."""
    lit = _literature()
    row = next(r for r in lit.ROWS if r.name == "Megatron 1.7B")
    err = row.predicted(lit.price(row)["step"]) / row.measured - 1
    assert err == pytest.approx(LITERATURE_RESIDUALS[row.name], abs=0.0015)


def test_band_line_names_the_extremes():
    line = error_band_line()
    errs = sorted(LITERATURE_RESIDUALS.values())
    assert f"{100 * errs[0]:+.0f}%" in line and f"{100 * errs[-1]:+.0f}%" in line and "13 published runs" in line
