"""Kernel tables: what ``autoshard profile`` measures on a GPU (GEMM, attention, copy, AdamW), how a
profile's tables replace the presets' constants, and that the measuring code runs (on the CPU here;
the H100 figures it produced are in benchmarks/RESULTS.md, issue 16 item 8)."""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.cost.kernels import attention_seconds, gemm_seconds, memory_seconds
from autoshard.passes.cost.profile_format import derive_hardware, kernel_table_fields
from autoshard.profiling.kernel_tables import KernelClock, measure_kernel_tables, time_gemm_table


def _profile_with_tables(gemm_rows, attention_rows, copy_rows, sm_count=132):
    """A profile as ``measure_profile`` writes it on a GPU of one rank, with the given tables."""
    fit = {"samples": [[1, 1.0], [2, 2.0]], "held_out": [], "fit": {"latency_s": 0.0, "seconds_per_unit": 1e-12}}
    return {"machine": {"device": "cuda", "world_size": 1, "devices_per_node": 1, "memory_bytes_per_device": 80e9},
            "matmul": {**fit, "samples": [[64, 64, 64, 1e-5], [128, 128, 128, 2e-5]]}, "memory": fit,
            "collectives": [], "device": {"name": "test gpu", "sm_count": sm_count},
            "gemm_table": {"rows": gemm_rows}, "attention_table": {"rows": attention_rows},
            "copy_table": {"rows": copy_rows}}


def test_a_profiles_kernel_tables_replace_the_preset_constants():
    m, n, k = 132 * 128, 1024, 8192  # 132 x 8 tiles of 128 x 128: whole waves on 132 SMs
    gemm_s = 2.0 * m * n * k / 700e12            # the table's fastest GEMM: 700 TFLOP/s
    slow_s = 2.0 * 4096 ** 3 / 500e12
    causal_fwd = 4.0 * 32 * 8192 * 8192 * 128 * 0.5 / 560e12  # attention forward at 560 TFLOP/s
    prof = _profile_with_tables([[m, n, k, "fwd", gemm_s], [4096, 4096, 4096, "fwd", slow_s]],
                                [[1, 32, 8192, 128, True, causal_fwd, 3.0 * causal_fwd]],
                                [[2 ** 30, 2 ** 30 / 3.0e12], [2 ** 28, 2 ** 28 / 2.8e12]])
    fields = kernel_table_fields(prof)
    assert fields["flops_bf16"] == pytest.approx(700e12)
    assert fields["sm_count"] == 132 and fields["gemm_efficiency"] == 1.0 and fields["comm_streams"] == 1
    assert fields["attention_efficiency"] == pytest.approx(560 / 700)
    assert fields["attention_backward_factor"] == pytest.approx(3.0)
    assert fields["memory_bandwidth"] == pytest.approx(3.0e12)
    hw = derive_hardware(prof, "measured")
    # the measured shapes price back at what was measured (whole waves: no quantisation loss), within the
    # output write-out the model adds after a GEMM's compute ((write / compute)^2 of it: 0.08% at K = 8192)
    assert gemm_seconds(hw, 1, m, n, k) == pytest.approx(gemm_s, rel=1e-3)
    fwd, bwd = attention_seconds(hw, 32, 8192, 8192, 128, causal=True)
    assert fwd == pytest.approx(causal_fwd, rel=1e-6) and bwd == pytest.approx(3.0 * causal_fwd, rel=1e-6)
    assert memory_seconds(hw, 3.0e12) == pytest.approx(1.0, rel=1e-6)
    # a partial last wave still costs a whole one: the tile model extrapolates from the table's rate
    assert gemm_seconds(hw, 1, m + 128, n, k) > gemm_seconds(hw, 1, m, n, k) * 9 / 8 * 0.99


def test_a_profile_without_tables_keeps_its_fitted_rates():
    prof = _profile_with_tables([], [], [])
    assert kernel_table_fields(prof) == {}
    hw = derive_hardware(prof, "cpu-like")
    assert hw.sm_count == 0 and hw.attention_backward_factor == 2.5 and hw.comm_streams == 0


def test_kernel_tables_measure_on_the_cpu():
    tables = measure_kernel_tables(torch.device("cpu"), quick=True)
    rows = tables["gemm_table"]["rows"]
    assert {r[3] for r in rows} == {"fwd", "dgrad", "wgrad"} and all(r[4] > 0 for r in rows)
    assert all(len(r) == 7 and r[5] > 0 and r[6] >= 0 for r in tables["attention_table"]["rows"])
    assert all(r[1] > 0 for r in tables["copy_table"]["rows"] + tables["adamw_table"]["rows"])
    assert "device" not in tables  # no sm_count on a CPU: its profile keeps the fitted rates
    with pytest.raises(ValueError, match="unknown GEMM layout"):
        time_gemm_table(KernelClock("cpu", repeats=1, warmup=0), [(8, 8, 8)], layouts=("sideways",))
