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


def _literature():
    spec = importlib.util.spec_from_file_location("literature", BENCH / "literature.py")
    lit = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = lit
    spec.loader.exec_module(lit)
    return lit


def _training_shape_attention_rows(preset):
    """(forward efficiency, backward / forward) of every measured SDPA row at the training shapes the
    preset cites (causal, sequence 8192, head_dim 128), from the files it cites."""
    rows = [r for r in _load("data/h200_profile.json" if preset == "h200" else "data/h100_calibration.json")
            ["attention_table"]["rows"] if r[4] and r[2] == 8192 and r[3] == 128]
    if preset == "h100":  # the layer probe's SDPA alone, batch 2, default kernel
        probe = _load("gpu_layer_probe_h100.json")
        rows += [[2, h, 8192, 128, True, probe[f"sdpa{h}_fwd_default"],
                  probe[f"sdpa{h}_fwdbwd_default"] - probe[f"sdpa{h}_fwd_default"]] for h in (32, 16)]
    peak = PRESETS[preset].flops_bf16
    return [(4.0 * b * h * s * s * d * 0.5 / fwd / peak, bwd / fwd) for b, h, s, d, _, fwd, bwd in rows]


@pytest.mark.parametrize("preset", ["h100", "h200"])
def test_attention_rates_are_the_measured_ones(preset):
    """The forward rate and the backward factor are both the median of the measured rows (SDPA's default
    kernel in torch 2.11, cuDNN attention first), not one fwd + bwd rate under an assumed 2.5x backward."""
    rows = _training_shape_attention_rows(preset)
    assert len(rows) >= 4
    hw = PRESETS[preset]
    assert hw.attention_efficiency == pytest.approx(statistics.median(e for e, _ in rows), abs=0.001)
    assert hw.attention_backward_factor == pytest.approx(statistics.median(f for _, f in rows), abs=0.005)


def test_attention_prices_the_measured_layer_shape():
    """The h100 preset at the 8B layer's SDPA (2 x 32 x 8192 x 128): forward and forward + backward within
    the spread of the two H100s that measured it; literature.py's 2024 torchtitan card: SDPA held to its
    flash kernel."""
    probe, cal = _load("gpu_layer_probe_h100.json"), _load("data/h100_calibration.json")
    cal_fwd, cal_bwd = next((f, b) for bb, h, s, d, c, f, b in cal["attention_table"]["rows"]
                            if (bb, h, s, d, c) == (2, 32, 8192, 128, True))
    fwd, bwd = attention_seconds(PRESETS["h100"], 2 * 32, 8192, 8192, 128, causal=True)
    # one rate for 8 to 32 heads: the median row's forward is 5% slower than this, the widest, shape's
    assert fwd == pytest.approx((probe["sdpa32_fwd_default"] + cal_fwd) / 2, rel=0.07)
    assert fwd + bwd == pytest.approx((probe["sdpa32_fwdbwd_default"] + cal_fwd + cal_bwd) / 2, rel=0.05)
    lit = _literature()
    flash = dataclasses.replace(PRESETS["h100"], attention_efficiency=lit.TORCH_2024_FLASH_ATTENTION_H100,
                                attention_backward_factor=lit.TORCH_2024_FLASH_BACKWARD_FACTOR)
    fwd, bwd = attention_seconds(flash, 2 * 32, 8192, 8192, 128, causal=True)
    assert fwd + bwd == pytest.approx(probe["sdpa32_fwdbwd_flash"], rel=0.01)


@pytest.mark.parametrize("kernel", ["flash", "default"])
def test_planner_prices_the_measured_torchtitan_layer(kernel):
    """Not a fit: the layer was measured in the same run as the attention rates but is not used to set
    any constant; the planner's per-op prices of the same program (``GraphFacts`` of torchtitan's
    block as ``benchmarks/torchtitan_llama_2024.py`` writes it) are checked against it, so that a change
    to the kernel classes, the GEMM model or the presets that moves a layer away from the GPU shows up
    (forward + backward within 5%: -2.9% flash, -1.6% cuDNN when written; the forward alone is 6% slow)."""
    lit = _literature()
    hw = PRESETS["h100"]
    if kernel == "flash":
        hw = dataclasses.replace(hw, attention_efficiency=lit.TORCH_2024_FLASH_ATTENTION_H100,
                                 attention_backward_factor=lit.TORCH_2024_FLASH_BACKWARD_FACTOR)
    sys.path.insert(0, str(BENCH))
    from torchtitan_llama_2024 import layer_probe_seconds
    fwd, both = layer_probe_seconds(hw)
    measured = _load("gpu_layer_probe_h100.json")
    assert both == pytest.approx(measured[f"layer_fwdbwd_{kernel}"], rel=0.05)
    assert fwd == pytest.approx(measured[f"layer_fwd_{kernel}"], rel=0.08)


def test_kernel_class_rates_are_the_measured_ones():
    """The memory-bound kernel classes' rates (``passes/cost/kernel_classes.py``) are the H100 probe's:
    the eager RMSNorm's and RoPE's forward at their counted bytes, over the copy's rate, each of the
    3.35 TB/s datasheet bandwidth."""
    from autoshard.passes.cost.kernel_classes import CLASS_RATIO, PROBE_RMSNORM_BYTES, PROBE_ROPE_BYTES
    eager = {op: (n, s) for op, n, s in _load("gpu_fidelity_probe_h100.json")["eager"]}
    bw = PRESETS["h100"].memory_bandwidth
    copy = eager["copy"][0] / eager["copy"][1] / bw
    norm = PROBE_RMSNORM_BYTES * eager["norm_f"][0] / eager["norm_f"][1] / bw
    rope = PROBE_ROPE_BYTES * eager["rope_f"][0] / eager["rope_f"][1] / bw
    assert CLASS_RATIO["elementwise"] == pytest.approx(norm / copy, rel=0.005)
    assert CLASS_RATIO["rope"] == pytest.approx(rope / copy, rel=0.005)
    assert PRESETS["h100"].memory_efficiency == pytest.approx(copy, abs=0.02)  # the preset's copy rate
