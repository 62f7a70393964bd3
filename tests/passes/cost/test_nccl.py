"""Collectives as NCCL prices them (passes/cost/nccl.py) and their use by the cost model."""
from __future__ import annotations

import dataclasses

import pytest

from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.model import CostModel
from autoshard.passes.cost.nccl import BASE_LAT, HW_LAT, nccl_p2p_seconds, nccl_terms
from autoshard.passes.mesh import Mesh

A100, H100 = PRESETS["a100"], PRESETS["h100"]


def seconds(kind, g, m, hw, nbytes):
    return min(f + p * nbytes for f, p in nccl_terms(kind, g, m, hw))


def test_large_ring_all_gather_runs_at_the_nvlink_bus_bandwidth():
    B = 4e9
    t = seconds("all_gather", 8, 1, A100, B)
    assert B * 7 / 8 / t == pytest.approx(240e9, rel=0.01)  # nccl-tests busbw = algbw * (n-1)/n


def test_small_messages_are_latency_bound_and_pick_a_low_latency_protocol():
    t = seconds("all_reduce", 8, 1, A100, 1024)
    ring_simple = (BASE_LAT["ring"]["Simple"] + 14 * HW_LAT["nvlink"]["ring"]["Simple"]) * 1e-6
    assert t < ring_simple / 3          # LL: 6.6 + 14 x 0.6 us, not Simple's 8.4 + 14 x 3.4 us
    assert t == pytest.approx((6.6 + 14 * 0.6) * 1e-6, rel=0.01)


def test_nvls_only_where_the_switch_reduces():
    B = 1e9
    h100 = seconds("all_reduce", 8, 1, H100, B)
    no_nvls = seconds("all_reduce", 8, 1, dataclasses.replace(H100, nvls_bus_factor=0.0), B)
    assert B * 2 * 7 / 8 / h100 > 440e9 > B * 2 * 7 / 8 / no_nvls  # NVLS 475 GB/s bus vs ring 370.8
    two_nodes = seconds("all_reduce", 8, 2, H100, B)                 # no NVLS across nodes
    assert two_nodes > h100


def test_across_nodes_the_ring_uses_one_nic_per_member():
    B = 4e9
    # 8 members per node, A100: 8 x 23.5 GB/s of NICs < 240 GB/s of NVLink
    t8 = seconds("reduce_scatter", 8, 4, A100, B)
    assert B * 31 / 32 / t8 == pytest.approx(8 * 23.5e9, rel=0.02)
    # one member per node (a data-parallel axis over nodes): one NIC
    t1 = seconds("reduce_scatter", 1, 32, A100, B)
    assert B * 31 / 32 / t1 == pytest.approx(23.5e9, rel=0.02)


def test_many_nodes_small_all_reduce_prefers_the_tree():
    ring = min(nccl_terms("all_reduce", 1, 256, A100)[:3], key=lambda c: c[0])
    assert seconds("all_reduce", 1, 256, A100, 4096) < ring[0]


def test_cost_model_uses_nccl_for_gpu_presets_and_a_fit_replaces_it():
    mesh = Mesh.of((4, 8))
    cm = CostModel(mesh, H100)
    assert cm.collective_time("all_gather", 1, 1e9) == pytest.approx(seconds("all_gather", 8, 1, H100, 1e9))
    assert cm.collective_time("all_gather", 0, 1e9) == pytest.approx(seconds("all_gather", 1, 4, H100, 1e9))
    fitted = dataclasses.replace(H100, collective_fits=(("all_gather", 8, 1e-5, 1e-11),))
    assert CostModel(mesh, fitted).collective_time("all_gather", 1, 1e9) == pytest.approx(1e-5 + 1e-2)
    assert cm.p2p(1e8, same_node=False) == pytest.approx(nccl_p2p_seconds(H100, 1e8, False))
    assert nccl_p2p_seconds(H100, 1e8, False) > nccl_p2p_seconds(H100, 1e8, True)
