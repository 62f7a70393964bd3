"""The GPU presets' measured constants match the measurement files they cite (benchmarks/*.json), and
literature.py's analytic layer stays close to the torchtitan layer measured on the same H100."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import statistics
import sys

import pytest

from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.kernels import attention_seconds, gemm_seconds

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name):
    return json.loads((BENCH / name).read_text())


@pytest.mark.parametrize("preset,path", [("h100", "gpu_fidelity_probe_h100.json"),
                                         ("h200", "gpu_sustained_gemm_h200.json")])
def test_sustained_gemm_rate_is_the_measured_one(preset, path):
    data = _load(path)
    measured = statistics.mean(data["sus"])            # FLOP/s of back-to-back 8192^3 products
    predicted = 2.0 * 8192 ** 3 / gemm_seconds(PRESETS[preset], 1, 8192, 8192, 8192)
    assert predicted == pytest.approx(measured, rel=0.005)


def test_causal_flash_attention_rate_is_the_measured_one():
    data = _load("gpu_layer_probe_h100.json")
    fwd, bwd = attention_seconds(PRESETS["h100"], 2 * 32, 8192, 8192, 128, causal=True)
    measured_fwd = data["sdpa32_fwd_flash"]
    measured_bwd = data["sdpa32_fwdbwd_flash"] - measured_fwd
    assert fwd == pytest.approx(measured_fwd, rel=0.03)
    assert bwd == pytest.approx(measured_bwd, rel=0.03)


def test_analytic_layer_predicts_the_measured_torchtitan_layer():
    """Not a fit: the layer was measured after the constants above were set, and is checked here so a
    change to literature.py's byte counts or the presets that moves it away from the GPU shows up."""
    spec = importlib.util.spec_from_file_location("literature", BENCH / "literature.py")
    lit = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = lit
    spec.loader.exec_module(lit)
    run = dataclasses.replace(lit.RUNS[10], recompute="none", hardware="h100")   # the 8B layer, 2 x 8192
    lt = lit.layer_times(run, lit.HARDWARE["h100"])
    measured = _load("gpu_layer_probe_h100.json")["layer_fwdbwd_flash"]
    assert lt["fwd"] + lt["bwd"] == pytest.approx(measured, rel=0.05)
