"""Collective formulas (ring, tree, hierarchical, point-to-point), measured fits and op overhead,
each against a value computed by hand."""
from __future__ import annotations

import json
import math

import pytest
import torch

from autoshard.passes.cost.collectives import (Collective, collective_seconds, collective_terms, hierarchical_terms,
                                                p2p_seconds)
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import R, S, Strategy, TensorMeta
from autoshard.testing.graphs import mlp_graph

# 4 devices per node; intra 10 GB/s, 1 us; inter 1 GB/s, 10 us; launch 2 us
HW = Hardware(name="toy", flops_bf16=2e12, flops_fp32=1e12, memory_bandwidth=1e11, memory_bytes=1e10,
              devices_per_node=4, intra_node_bandwidth=1e10, intra_node_latency=1e-6,
              inter_node_bandwidth=1e9, inter_node_latency=1e-5, collective_launch_s=2e-6)
B = 8e6


def test_ring_tree_auto_and_p2p_by_hand():
    bw, lat = 1e9, 1e-5
    # ring, n = 8: all-reduce 2*7/8 B/bw + 14 lat; all-gather 7/8 B/bw + 7 lat; all-to-all 7/64 B/bw + 7 lat
    assert collective_seconds("all_reduce", B, 8, bw, lat) == pytest.approx(0.014 + 14e-5)
    assert collective_seconds("all_gather", B, 8, bw, lat) == pytest.approx(0.007 + 7e-5)
    assert collective_seconds("reduce_scatter", B, 8, bw, lat) == pytest.approx(0.007 + 7e-5)
    assert collective_seconds("all_to_all", B, 8, bw, lat) == pytest.approx(0.000875 + 7e-5)
    # tree, n = 8: 2 * log2(8) = 6 latency steps, 2 B / bw
    assert collective_seconds("all_reduce", B, 8, bw, lat, algorithm="tree") == pytest.approx(0.016 + 6e-5)
    # auto: the cheaper. Large message: ring (0.01414 < 0.01606); tiny message: tree (6 steps < 14)
    assert collective_seconds("all_reduce", B, 8, bw, lat, algorithm="auto") == pytest.approx(0.014 + 14e-5)
    assert collective_seconds("all_reduce", 80, 8, bw, lat, algorithm="auto") == pytest.approx(160 / 1e9 + 6e-5)
    assert collective_terms("all_gather", 4, 1e9, 1e-5) == pytest.approx((3e-5, 0.75e-9))
    assert p2p_seconds(1e6, 1e9, 1e-5, launch=2e-6) == pytest.approx(1e-3 + 1e-5 + 2e-6)
    assert collective_seconds("all_reduce", B, 1, bw, lat, launch=1.0) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_terms("broadcast", 4, bw, lat)


def test_axis_locality_splits_axes_over_nodes():
    assert HW.axis_locality(Mesh.of((4,)), 0) == (4, 1)     # one node
    assert HW.axis_locality(Mesh.of((8,)), 0) == (4, 2)     # 4 per node, 2 nodes
    assert HW.axis_locality(Mesh.of((4, 2)), 0) == (2, 2)   # stride 2: 2 members per node
    assert HW.axis_locality(Mesh.of((2, 4)), 0) == (1, 2)   # stride 4: each member on its own node
    assert HW.axis_locality(Mesh.of((2, 4)), 1) == (4, 1)


def test_group_locality_of_axes_flattened():
    assert HW.group_locality(Mesh.of((2, 4)), 1) == HW.axis_locality(Mesh.of((2, 4)), 1)
    assert HW.group_locality(Mesh.of((2, 4)), (0, 1)) == (4, 2)      # all 8 ranks: 4 per node, 2 nodes
    assert HW.group_locality(Mesh.of((2, 2, 2)), (1, 2)) == (4, 1)   # ranks 0-3: one node
    assert HW.group_locality(Mesh.of((2, 2, 2)), (0, 2)) == (2, 2)   # ranks 0, 1, 4, 5: 2 per node
    assert HW.group_locality(Mesh.of((2, 2, 2)), (0, 1)) == (2, 2)   # ranks 0, 2, 4, 6 (stride 2)


def test_fsdp_gather_over_two_axes_is_one_flat_collective():
    """(S(0), S(0)) -> (R, R) is one all-gather over both axes flattened (what the runtime runs):
    on (2, 4) with 4 per node, a hierarchical gather of 1/4 of B across the 2 nodes, then B inside
    the node -- not an inter-node gather of the whole B on axis 0 after an intra-node one on axis 1."""
    mesh = Mesh.of((2, 4))
    cm = CostModel(mesh, HW)
    meta = TensorMeta((8, 1000 * 1000), torch.float32)  # B = 32 MB
    nb = meta.nbytes
    got = cm.reshard((S(0), S(0)), (R, R), meta, needs_grad=True)
    assert [(c.kind, c.axis, c.bytes, c.phase) for c in got] == [
        ("all_gather", (0, 1), nb, "fwd"), ("reduce_scatter", (0, 1), nb, "bwd")]
    across = 0.5 * nb / 4 / 1e9 + 1e-5   # 2 nodes, B/g per group
    inside = 0.75 * nb / 1e10 + 3e-6     # 4 members, all of B
    assert got[0].seconds == pytest.approx(across + inside + 2e-6)
    assert got[1].seconds == pytest.approx(across + inside + 2e-6)
    assert Collective.from_json(json.loads(json.dumps(got[0].to_json()))) == got[0]   # plans save it
    per_axis = cm.collective_time("all_gather", 1, nb / 2) + cm.collective_time("all_gather", 0, nb)
    assert got[0].seconds < per_axis / 2  # the whole B over the NIC is what the flat gather avoids
    # one axis, or gathers that end in a chunk, stay per axis
    assert [c.axis for c in cm.reshard((S(0), R), (R, R), meta, False)] == [0]
    assert [c.axis for c in cm.reshard((S(0), S(0)), (R, S(1)), meta, False)] == [1, 0]


def test_hierarchical_all_reduce_by_hand_and_against_flat():
    mesh = Mesh.of((8,))  # 4 per node x 2 nodes
    hier, flat = CostModel(mesh, HW), CostModel(mesh, HW, hierarchical=False)
    # reduce-scatter in node (3/4 B / 10 GB/s + 3 us) + all-reduce across 2 nodes of B/4
    # (2 * 1/2 * B/4 / 1 GB/s + 2 * 10 us) + all-gather in node (3/4 B / 10 GB/s + 3 us) + launch 2 us
    by_hand = (0.75 * B / 1e10 + 3e-6) + (B / 4 / 1e9 + 2e-5) + (0.75 * B / 1e10 + 3e-6) + 2e-6
    assert hier.collective_time("all_reduce", 0, B) == pytest.approx(by_hand)
    # flat: the whole ring at the inter-node link: 2 * 7/8 B / 1 GB/s + 14 * 10 us + launch
    assert flat.collective_time("all_reduce", 0, B) == pytest.approx(1.75 * B / 1e9 + 14e-5 + 2e-6)
    assert hier.collective_time("all_reduce", 0, B) < flat.collective_time("all_reduce", 0, B) / 4
    # all-gather: across nodes on B/4 (1/2 * B/4 / 1 GB/s + 10 us), then in node (3/4 B / 10 GB/s + 3 us)
    assert hier.collective_time("all_gather", 0, B) == pytest.approx(
        (0.5 * B / 4 / 1e9 + 1e-5) + (0.75 * B / 1e10 + 3e-6) + 2e-6)
    assert hier.collective_time("reduce_scatter", 0, B) == pytest.approx(hier.collective_time("all_gather", 0, B))
    # all-to-all: 3/64 of B over the intra link, 4/64 over the inter link; 3 intra + 4 inter latencies
    assert hier.collective_time("all_to_all", 0, B) == pytest.approx(
        3 / 64 * B / 1e10 + 4 / 64 * B / 1e9 + 3e-6 + 4e-5 + 2e-6)
    # members on separate nodes (g = 1): hierarchical and flat agree
    m2 = Mesh.of((2, 4))
    assert CostModel(m2, HW).collective_time("all_reduce", 0, B) == pytest.approx(
        CostModel(m2, HW, hierarchical=False).collective_time("all_reduce", 0, B))
    assert hierarchical_terms("all_reduce", 4, 1, (1e10, 1e-6), (1e9, 1e-5)) == pytest.approx(
        collective_terms("all_reduce", 4, 1e10, 1e-6))


def test_measured_fits_replace_the_formula_inside_a_node_only():
    fitted = Hardware(**{**HW.to_json(), "collective_fits": (("all_reduce", 4, 1e-4, 1e-9), ("send_recv", 2, 5e-5, 2e-9))})
    assert fitted.collective_fit("all_reduce", 4) == (1e-4, 1e-9)
    assert fitted.collective_fit("all_reduce", 2) is None
    cm = CostModel(Mesh.of((4,)), fitted)
    assert cm.collective_time("all_reduce", 0, B) == pytest.approx(1e-4 + 1e-9 * B)
    # no fit for all-gather over 4: the formula (ring at the intra link) plus launch
    assert cm.collective_time("all_gather", 0, B) == pytest.approx(0.75 * B / 1e10 + 3e-6 + 2e-6)
    # a size-4 axis that spans nodes ((4, 2): stride 2 -> 2 per node) is not what was measured
    cross = CostModel(Mesh.of((4, 2)), fitted)
    assert cross.collective_time("all_reduce", 0, B) != pytest.approx(1e-4 + 1e-9 * B)
    assert cm.p2p(1e6) == pytest.approx(5e-5 + 2e-3)
    assert cm.p2p(1e6, same_node=False) == pytest.approx(1e-5 + 1e6 / 1e9 + 2e-6)
    assert CostModel(Mesh.of((4,)), HW).p2p(1e6) == pytest.approx(1e-6 + 1e6 / 1e10 + 2e-6)
    # the fitted slope also prices a gradient all-reduce
    (c,) = CostModel(Mesh.of((4,)), fitted, grad_bucket_bytes=1e6).grad_sync(TensorMeta((250_000,), torch.float32), (R,))
    assert c.seconds == pytest.approx(1e-9 * 1e6 + 1e-4)


def test_gradient_bucket_never_exceeds_the_model():
    meta = TensorMeta((1024,), torch.float32)  # 4 KiB of a 16 KiB model: a quarter of the one bucket
    cm = CostModel(Mesh.of((4,)), HW)
    (c,) = cm.grad_sync(meta, (R,), total_bytes=16384)
    stream = 1.5 * 4096 / 1e10
    assert c.seconds == pytest.approx(stream + 0.25 * (6e-6 + 2e-6))
    (c,) = cm.grad_sync(meta, (R,))  # without the cap: 4 KiB of a 25 MiB bucket
    assert c.seconds == pytest.approx(stream + 4096 / (25 * 2 ** 20) * 8e-6)


def test_op_overhead_is_paid_per_launch_and_not_divided_by_sharding():
    slow = Hardware(**{**HW.to_json(), "op_overhead_s": 1e-3})
    cg = mlp_graph(64, 256, 32)
    facts, base = GraphFacts(cg, slow), GraphFacts(cg, HW)
    lin2 = [n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.linear.default][1]
    assert facts.launches(lin2.name) == 4  # forward + dX + dW + the bias gradient's sum
    assert facts.compute(lin2.name) == base.compute(lin2.name)
    dp = Strategy(((S(0),), (R,), (R,)), ((S(0),),), (None,))
    cm, cm0 = CostModel(Mesh.of(4), slow), CostModel(Mesh.of(4), HW)
    assert cm.price_node(lin2.name, dp, facts).compute == pytest.approx(
        cm0.price_node(lin2.name, dp, base).compute + 4e-3)
    views = [n for n in facts.views if facts.launches(n)]
    assert all(facts.compute(n) == (0.0, 0.0) for n in views)


def test_hardware_rejects_bad_algorithm_and_fits_and_round_trips():
    with pytest.raises(AutoshardError, match="collective_algorithm"):
        Hardware(**{**HW.to_json(), "collective_algorithm": "butterfly"})
    with pytest.raises(AutoshardError, match="bad collective fit"):
        Hardware(**{**HW.to_json(), "collective_fits": (("all_reduce", 1, 0.0, 0.0),)})
    with pytest.raises(AutoshardError, match="each collective_fits entry"):
        Hardware(**{**HW.to_json(), "collective_fits": (("all_reduce", 4),)})
    hw = Hardware(**{**HW.to_json(), "collective_algorithm": "auto",
                     "collective_fits": (("all_gather", 2, 1e-5, 1e-9),)})
    import json
    assert Hardware.from_json(json.loads(json.dumps(hw.to_json()))) == hw
    assert math.isfinite(hash(hw))
    tree = CostModel(Mesh.of((4,)), Hardware(**{**HW.to_json(), "collective_algorithm": "auto"}))
    assert tree.collective_time("all_reduce", 0, 8) == pytest.approx(
        collective_seconds("all_reduce", 8, 4, 1e10, 1e-6, 2e-6, "tree"))
