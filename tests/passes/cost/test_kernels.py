"""Achievable compute (passes/cost/kernels.py) and its use by GraphFacts / CostModel."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.passes.cost.facts import GraphFacts, local_gemm_dims
from autoshard.passes.cost.hardware import PRESETS, Hardware
from autoshard.passes.cost.kernels import (attention_seconds, gemm_efficiency, gemm_seconds, memory_seconds,
                                           optimizer_seconds)
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import AutoshardError
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import R, S, Strategy
from autoshard.testing.graphs import mlp_graph

H100 = PRESETS["h100"]


def test_big_gemm_reaches_the_measured_cap_and_never_more():
    eff = gemm_efficiency(H100, 1, 132 * 128, 4096, 8192)  # 8 * 132 tiles of 128x128: whole waves
    assert eff == pytest.approx(H100.gemm_efficiency)
    for shape in [(1, 8192, 8192, 8192), (4, 2048, 3000, 512), (1, 100, 100, 100)]:
        assert 0 < gemm_efficiency(H100, *shape) <= H100.gemm_efficiency


def test_wave_quantisation_one_tile_too_many_costs_a_wave():
    whole = gemm_seconds(H100, 1, 132 * 128, 1024, 8192)   # 8 x 132 tiles of 128x128: 8 full waves
    over = gemm_seconds(H100, 1, 133 * 128, 1024, 8192)    # 8 tiles more: 0.75% more work, a 9th wave
    assert over / whole > 1.1


def test_skinny_gemm_is_memory_bound():
    m, n, k = 8, 8192, 8192
    moved = (m * k + k * n + m * n) * 2
    assert gemm_seconds(H100, 1, m, n, k) == pytest.approx(moved / (H100.memory_bandwidth * H100.memory_efficiency))


def test_attention_causal_halves_work_and_backward_recomputes():
    full = attention_seconds(H100, 32 * 16, 8192, 8192, 128, causal=False)
    causal = attention_seconds(H100, 32 * 16, 8192, 8192, 128, causal=True)
    assert causal[0] == pytest.approx(full[0] / 2)
    assert full[1] == pytest.approx(2.5 * full[0])
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


def test_a_badly_quantised_shard_costs_more_than_an_even_split():
    captured = mlp_graph(1024, 132 * 128, 132 * 128)
    mesh = Mesh.of((8,))
    facts = GraphFacts(captured, H100)
    cm = CostModel(mesh, H100)
    name = next(iter(facts.gemm_dims))
    dims = facts.gemm_dims[name]
    r = dims[5]
    out_last = Strategy(inputs=((R,),) * 2, outputs=((S(r - 1),),))
    # N = 16896 is 132 whole waves of 128-wide tiles; an eighth (2112) is 16.5 tiles wide: 17 waves
    assert dims[:4] == (1, 132 * 128, 132 * 128, 1024)
    assert cm.gemm_shard_factor(name, dims, out_last) == pytest.approx(17 / 16.5)
