"""Achievable compute (passes/cost/kernels.py) and its use by GraphFacts / CostModel."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.facts import GraphFacts, local_gemm_dims
from autoshard.passes.cost.hardware import PRESETS, Hardware
from autoshard.passes.cost.kernels import (attention_seconds, gemm_efficiency, gemm_seconds, memory_seconds,
                                           optimizer_seconds)
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import AutoshardError
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import R, S, Strategy
from autoshard.testing.graphs import mlp_graph
from autoshard.testing.models import MLP

H100 = PRESETS["h100"]


def test_big_gemm_reaches_the_measured_cap_and_never_more():
    eff = gemm_efficiency(H100, 1, 132 * 128, 4096, 8192)  # 8 * 132 tiles of 128x128: whole waves
    # within the output write-out left after the compute ((write / compute)^2 of it at K = 8192: 0.08%)
    assert eff == pytest.approx(H100.gemm_efficiency, rel=2e-3) and eff <= H100.gemm_efficiency
    for shape in [(1, 8192, 8192, 8192), (4, 2048, 3000, 512), (1, 100, 100, 100)]:
        assert 0 < gemm_efficiency(H100, *shape) <= H100.gemm_efficiency


def test_wave_quantisation_one_tile_too_many_costs_a_wave():
    whole = gemm_seconds(H100, 1, 132 * 128, 1024, 8192)   # 8 x 132 tiles of 128x128: 8 full waves
    over = gemm_seconds(H100, 1, 133 * 128, 1024, 8192)    # 8 tiles more: 0.75% more work, a 9th wave
    assert over / whole > 1.1


def test_skinny_gemm_is_memory_bound():
    m, n, k = 8, 8192, 8192
    moved = (m * k + k * n + m * n) * 2
    # the operands once through HBM, plus the fp32 partial sums of the K split that fills the SMs (< 1%)
    assert gemm_seconds(H100, 1, m, n, k) == pytest.approx(moved / (H100.memory_bandwidth * H100.memory_efficiency),
                                                           rel=0.01)


def test_skinny_fp32_gemm_is_near_its_roofline():
    m, n, k = 16, 8192, 8192  # fp32 on the CUDA cores: a 32-row SIMT tile pads 16 rows to 32
    roofline = (m * k + k * n + m * n) * 4 / (H100.memory_bandwidth * H100.memory_efficiency)
    assert roofline <= gemm_seconds(H100, 1, m, n, k, 4) <= 1.1 * roofline


_SIZES = sorted({*range(1, 300, 7), 63, 64, 65, 96, 127, 128, 129, 255, 256, 257, 1000, 4095, 4096, 4097,
                 132 * 128, 133 * 128, 20000})


@pytest.mark.parametrize("preset", ["a100", "h100"])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_gemm_time_grows_with_every_dimension(preset, itemsize):
    """More rows, columns, depth or batch never cost less (no threshold where the price drops)."""
    hw = PRESETS[preset]
    for other in ((512, 512), (4096, 1024), (96, 16384)):
        for dim in range(4):
            times = []
            for size in _SIZES:
                shape = [1, *other, other[0]]
                shape[dim] = size if dim else max(1, size // 64)
                times.append(gemm_seconds(hw, *shape, itemsize))
            assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:])), (preset, itemsize, other, dim)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_no_jump_at_the_former_skinny_threshold(itemsize):
    """Below 128 rows a GEMM used to run at the capped rate on every SM, at 128 rows on one tile's SMs:
    0.80 against 0.024 of the fp32 peak. Now a row costs no more at 128 rows than at 96 or 127."""
    for n, k in ((512, 512), (2048, 512), (4096, 4096)):
        t96, t127, t128 = (gemm_seconds(H100, 1, m, n, k, itemsize) for m in (96, 127, 128))
        assert t96 <= t127 <= t128 <= t127 * 128 / 127 and t128 <= t96 * 128 / 96
        e96, e128 = (gemm_efficiency(H100, 1, m, n, k, itemsize) for m in (96, 128))
        assert e128 >= e96 * 0.999


@pytest.mark.parametrize("itemsize", [2, 4])
def test_microbatches_never_cost_less_than_one_gemm_of_all_their_rows(itemsize):
    """What gradient accumulation relies on: ``a`` GEMMs of ``m`` rows take at least as long as one of ``a m``."""
    for m in (8, 33, 64, 96, 100, 128, 200, 1024, 4000):
        for n, k in ((512, 512), (2048, 512), (4096, 4096), (14336, 4096)):
            for a in (2, 3, 4, 8):
                one_gemm = gemm_seconds(H100, 1, a * m, n, k, itemsize)
                assert a * gemm_seconds(H100, 1, m, n, k, itemsize) * (1 + 1e-12) >= one_gemm


def test_no_gemm_is_faster_than_a_launch_or_its_roofline():
    for shape in [(1, 1, 1, 1), (1, 8, 8, 8), (1, 64, 512, 512), (8, 128, 128, 64)]:
        assert gemm_seconds(H100, *shape) >= H100.min_kernel_s
    assert gemm_seconds(H100, 1, 1, 1, 1) == H100.min_kernel_s
    for b, m, n, k in [(1, 200, 8192, 8192), (4, 1000, 3000, 7000), (1, 8192, 8192, 8192)]:
        peak_s = 2.0 * b * m * n * k / (H100.flops_bf16 * H100.gemm_efficiency)
        moved_s = b * (m * k + k * n + m * n) * 2 / (H100.memory_bandwidth * H100.memory_efficiency)
        assert gemm_seconds(H100, b, m, n, k) >= max(peak_s, moved_s) * (1 - 1e-12)


def test_attention_causal_halves_work_and_backward_recomputes():
    full = attention_seconds(H100, 32 * 16, 8192, 8192, 128, causal=False)
    causal = attention_seconds(H100, 32 * 16, 8192, 8192, 128, causal=True)
    assert causal[0] == pytest.approx(full[0] / 2)
    assert full[1] == pytest.approx(H100.attention_backward_factor * full[0])
    plain = dataclasses.replace(H100, attention_backward_factor=Hardware.attention_backward_factor)
    assert attention_seconds(plain, 32 * 16, 8192, 8192, 128, causal=False)[1] == pytest.approx(2.5 * full[0])
    flops = 4.0 * 32 * 16 * 8192 * 8192 * 128
    assert full[0] == pytest.approx(flops / (H100.flops_bf16 * H100.attention_efficiency))


def test_memory_bound_and_optimizer_at_achievable_bandwidth():
    assert memory_seconds(H100, 1e9) == pytest.approx(1e9 / (3.35e12 * 0.9))
    assert memory_seconds(H100, 1.0) == H100.min_kernel_s  # a tiny kernel still lasts its launch
    assert optimizer_seconds(H100, 1e9) == pytest.approx(28e9 / (3.35e12 * 0.9))


def test_hardware_without_sm_count_prices_at_peak():
    cpu = PRESETS["cpu"]
    assert gemm_efficiency(cpu, 1, 7, 3, 5) == 1.0
    assert memory_seconds(cpu, 1e9) == pytest.approx(1e9 / cpu.memory_bandwidth)
    with pytest.raises(AutoshardError, match="gemm_efficiency"):
        dataclasses.replace(H100, gemm_efficiency=1.5)
    with pytest.raises(AutoshardError, match="collective_model"):
        dataclasses.replace(H100, collective_model="magic")


def test_facts_price_matmuls_at_achieved_not_peak():
    captured = mlp_graph(4096, 4096, 4096)
    cpu_like = dataclasses.replace(H100, sm_count=0)
    peak, real = GraphFacts(captured, cpu_like), GraphFacts(captured, H100)
    mms = [n for n in real.gemm_dims]
    assert mms, "the MLP's matmuls carry their GEMM shapes"
    for name in mms:
        assert real.compute(name)[0] > peak.compute(name)[0] / H100.gemm_efficiency * 0.999
    assert not peak.gemm_dims


def test_local_shard_shape_sets_the_efficiency():
    dims = (1, 4096, 4096, 4096, 2, 2, 0.8)
    assert local_gemm_dims(dims, (1,), (8,)) == (1, 4096, 512, 4096, 2)   # S(last): N split
    assert local_gemm_dims(dims, (0,), (8,)) == (1, 512, 4096, 4096, 2)   # S(0): M split
    assert local_gemm_dims(dims, (-2,), (8,)) == (1, 4096, 4096, 512, 2)  # partial: K split
    assert local_gemm_dims(dims, (-1,), (8,)) == (1, 4096, 4096, 4096, 2)


def _bf16_mlp_graph(d: int, hidden: int, batch: int):
    with torch.device("meta"):
        model = MLP(d, hidden).to(torch.bfloat16)
    x = torch.empty(batch, d, device="meta", dtype=torch.bfloat16)
    return capture(model, (x,), loss_fn=F.mse_loss, target=torch.empty_like(x))


def test_a_badly_quantised_shard_costs_more_than_an_even_split():
    captured = _bf16_mlp_graph(1024, 132 * 128, 132 * 128)  # tensor-core tiles (fp32 has narrower SIMT ones)
    mesh = Mesh.of((8,))
    facts = GraphFacts(captured, H100)
    cm = CostModel(mesh, H100)
    name = next(iter(facts.gemm_dims))
    dims = facts.gemm_dims[name]
    r = dims[5]
    out_last = Strategy(inputs=((R,),) * 2, outputs=((S(r - 1),),))
    # N = 16896 is 132 whole waves of 128-wide tiles; an eighth (2112) is 16.5 tiles wide: 17 waves
    assert dims[:4] == (1, 132 * 128, 132 * 128, 1024)
    # (the output write-out left after each shape's compute, ``exposed_write``, moves it by 0.3%)
    assert cm.gemm_shard_factor(name, dims, out_last) == pytest.approx(17 / 16.5, rel=5e-3)
