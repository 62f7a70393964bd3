"""Cost model and hardware: formulas against hand-computed values."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from autoshard.passes.cost.collectives import collective_seconds
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel, encode, optimizer_state_bytes
from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.hardware import PRESETS, Hardware
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import P, R, S, Strategy, TensorMeta
from autoshard.testing.graphs import mlp_graph

# round numbers so every expected value below is easy to check by hand
HW = Hardware(name="toy", flops_bf16=2e12, flops_fp32=1e12, memory_bandwidth=1e11, memory_bytes=1e10,
              devices_per_node=2, intra_node_bandwidth=1e10, intra_node_latency=1e-6,
              inter_node_bandwidth=1e9, inter_node_latency=1e-5, collective_launch_s=0.0)


def test_collective_formulas():
    B, n, bw, lat = 8e6, 4, 1e9, 1e-5
    assert collective_seconds("all_reduce", B, n, bw, lat) == pytest.approx(2 * 3 / 4 * B / bw + 2 * 3 * lat)
    assert collective_seconds("all_gather", B, n, bw, lat) == pytest.approx(3 / 4 * B / bw + 3 * lat)
    assert collective_seconds("reduce_scatter", B, n, bw, lat) == pytest.approx(3 / 4 * B / bw + 3 * lat)
    assert collective_seconds("all_to_all", B, n, bw, lat) == pytest.approx(3 / 16 * B / bw + 3 * lat)
    assert collective_seconds("all_reduce", B, 1, bw, lat) == 0.0
    assert collective_seconds("all_gather", B, n, bw, lat, launch=7e-6) == pytest.approx(
        3 / 4 * B / bw + 3 * lat + 7e-6)


def test_axis_links_follow_node_boundaries():
    mesh = Mesh.of((2, 2, 2))  # devices_per_node = 2: only the last axis stays inside a node
    assert HW.axis_link(mesh, 2) == (1e10, 1e-6)
    assert HW.axis_link(mesh, 1) == (1e9, 1e-5)
    assert HW.axis_link(mesh, 0) == (1e9, 1e-5)
    assert get_hardware("h100").axis_link(Mesh.of((2, 8)), 1) == (450e9, 2e-6)
    assert get_hardware("h100").axis_link(Mesh.of((2, 8)), 0) == (50e9, 5e-6)
    assert get_hardware("h100").axis_link(Mesh.of((8,)), 0)[0] == 450e9


def test_reshard_itemizes_each_axis_with_bytes_of_that_point():
    mesh = Mesh.of((2, 2))  # axis 0 inter-node (1 GB/s), axis 1 intra-node (10 GB/s)
    cm = CostModel(mesh, HW)
    meta = TensorMeta((8, 1000), torch.float32)  # 32,000 bytes
    ag0 = 0.5 * 32000 / 1e9 + 1e-5
    got = cm.reshard((S(0), R), (R, R), meta, needs_grad=True)
    assert [(c.kind, c.axis, c.bytes, c.phase) for c in got] == [
        ("all_gather", 0, 32000, "fwd"), ("reduce_scatter", 0, 32000, "bwd")]
    assert got[0].seconds == pytest.approx(ag0) and got[1].seconds == pytest.approx(ag0)
    # two gathers, as the runtime runs them: the last axis first while axis 0 still splits the
    # tensor (16,000 bytes over the 10 GB/s link), then axis 0 on the full 32,000 (1 GB/s)
    got = cm.reshard((S(0), S(1)), (R, R), meta, needs_grad=False)
    assert [(c.kind, c.axis, c.bytes) for c in got] == [("all_gather", 1, 16000), ("all_gather", 0, 32000)]
    # a gather on dim 1 also copies its input (8,000 B) and output (16,000 B) to and from the layout
    # the call needs, read and written at the memory bandwidth (passes/cost/runtime_host.py)
    assert got[0].seconds == pytest.approx(0.5 * 16000 / 1e10 + 1e-6 + 2 * (8000 + 16000) / 1e11)
    assert got[1].seconds == pytest.approx(0.5 * 32000 / 1e9 + 1e-5)
    # partial -> replicate: all-reduce both ways; partial -> shard: reduce-scatter, adjoint all-gather
    got = cm.reshard((P, R), (R, R), meta, needs_grad=True)
    assert [(c.kind, c.phase) for c in got] == [("all_reduce", "fwd"), ("all_reduce", "bwd")]
    assert got[0].seconds == pytest.approx(2 * 0.5 * 32000 / 1e9 + 2 * 1e-5 + 2 * 32000 / 1e11)  # + the clone it reduces
    got = cm.reshard((R, P), (R, S(0)), meta, needs_grad=True)
    assert [(c.kind, c.axis, c.phase) for c in got] == [("reduce_scatter", 1, "fwd"), ("all_gather", 1, "bwd")]
    # shard dim change: all-to-all of the full per-group bytes
    got = cm.reshard((S(0), R), (S(1), R), meta, needs_grad=False)
    assert [(c.kind, c.bytes) for c in got] == [("all_to_all", 32000)]
    assert got[0].seconds == pytest.approx(0.25 * 32000 / 1e9 + 1e-5 + 2 * (16000 + 16000) / 1e11)  # + 2 layout copies
    # ... but not when another axis nests in the same dim: gather both, then chunk (no all-to-all)
    got = cm.reshard((S(0), S(0)), (S(1), S(0)), meta, needs_grad=False)
    assert [(c.kind, c.axis, c.bytes) for c in got] == [("all_gather", 1, 16000), ("all_gather", 0, 32000)]
    # chunks are free; gathers run before chunks, so a chunk on another axis does not shrink them
    assert cm.reshard((R, R), (S(0), S(1)), meta, True) == ()
    assert cm.reshard((R, R), (P, R), meta, True) == ()
    got = cm.reshard((S(0), R), (R, S(0)), meta, needs_grad=False)
    assert [(c.kind, c.axis, c.bytes) for c in got] == [("all_gather", 0, 32000)]
    # a kept shard whose parent split changes is gathered and chunked again
    got = cm.reshard((R, S(0)), (S(0), S(0)), meta, needs_grad=False)
    assert [(c.kind, c.axis, c.bytes) for c in got] == [("all_gather", 1, 32000)]
    assert cm.reshard_memory((S(0), R), (R, R), meta) == 32000
    assert cm.reshard_memory((R, R), (S(0), R), meta) == 0.0


def test_reshard_runs_the_runtime_steps_for_every_placement_pair():
    """The cost model's collectives are the steps the runtime runs (``runtime.lower`` emits
    ``passes.layout.redistribution.plan_redistribute``'s steps, all-gathers of one dim over several
    axes as one over them flattened: ``fused_gather``), in order, on every pair of placements of a
    2-D tensor over (2, 2) and (2, 1, 2) meshes."""
    from autoshard.passes.layout.gathers import fused_gather
    from autoshard.runtime.redistribute import plan_redistribute
    meta = TensorMeta((8, 8), torch.float32)
    for shape in ((2, 2), (2, 1, 2)):
        cm = CostModel(Mesh.of(shape), HW if len(shape) == 2 else PRESETS["h100"])
        options = [R, P, S(0), S(1)]
        pairs = 0
        for src in itertools.product(options, repeat=len(shape)):
            for dst in itertools.product(options, repeat=len(shape)):
                planned = plan_redistribute(src, dst, shape, 2)
                flat = fused_gather(planned)
                steps = [("all_gather", flat[0])] if flat and len(flat[0]) > 1 else [(s.kind, s.axis) for s in planned]
                comm = [st for st in steps if st[0] not in ("chunk", "to_partial")]
                got = cm.reshard(src, dst, meta, needs_grad=True)
                assert [(c.kind, c.axis) for c in got if c.phase == "fwd"] == comm, (src, dst)
                pairs += 1
        assert pairs == 4 ** (2 * len(shape))


def test_compute_flops_memory_bound_and_local_division():
    cg = mlp_graph(64, 256, 32)  # fp32: matmuls at 1 TFLOP/s, the rest at 100 GB/s
    facts = GraphFacts(cg, HW)
    nodes = {n.name: n for n in cg.gm.graph.nodes}
    lin1, lin2 = [n for n in nodes.values() if n.target == torch.ops.aten.linear.default]
    gelu = next(n for n in nodes.values() if n.target == torch.ops.aten.gelu.default)
    fwd1 = 2 * 32 * 64 * 256 / 1e12
    assert facts.compute(lin1.name) == pytest.approx((fwd1, fwd1))  # x needs no grad: only dW
    assert facts.compute(lin2.name) == pytest.approx((fwd1, 2 * fwd1))  # dX and dW
    moved = 2 * 32 * 256 * 4 / 1e11
    assert facts.compute(gelu.name) == pytest.approx((moved, moved))
    cm = CostModel(Mesh.of(4), HW)
    replicated = Strategy(((R,), (R,), (R,)), ((R,),), (None,))
    dp = Strategy(((S(0),), (R,), (R,)), ((S(0),),), (None,))
    assert cm.price_node(lin2.name, replicated, facts).compute == pytest.approx(3 * fwd1)
    assert cm.price_node(lin2.name, dp, facts).compute == pytest.approx(3 * fwd1 / 4)
    assert cm.price_node(lin2.name, dp, facts).activations == 32 * 64 * 4 / 4


def test_parameter_memory_grad_sync_and_optimizer_state():
    mesh = Mesh.of((2, 2))
    meta = TensorMeta((1024, 1024), torch.float32)  # 4 MiB
    adam = CostModel(mesh, HW, "adamw")
    assert adam.param_memory(meta, (R, R)) == (4 * 2 ** 20, 4 * 2 ** 20, 8 * 2 ** 20)
    assert adam.param_memory(meta, (S(0), S(1))) == (2 ** 20, 2 ** 20, 2 * 2 ** 20)
    assert CostModel(mesh, HW, "sgd").param_memory(meta, (R, R))[2] == 0  # plain SGD, no momentum
    assert CostModel(mesh, HW, "sgd_momentum").param_memory(meta, (R, R))[2] == 4 * 2 ** 20  # the momentum buffer
    assert optimizer_state_bytes(12) == 12.0
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_state_bytes("lion?")
    # grad sync: one all-reduce per R axis of the local grad; a full bucket pays latency in full
    syncs = CostModel(mesh, HW, grad_bucket_bytes=2 ** 20).grad_sync(meta, (R, S(0)))
    assert [(c.kind, c.axis, c.bytes) for c in syncs] == [("all_reduce", 0, 2 * 2 ** 20)]
    assert syncs[0].seconds == pytest.approx(2 * 0.5 * 2 * 2 ** 20 / 1e9 + 2 * 1e-5)
    assert adam.grad_sync(meta, (S(1), S(0))) == ()
    # a small gradient shares its bucket: it pays only its share of the latency
    small = TensorMeta((1024,), torch.float32)
    (c,) = CostModel(Mesh.of(2), HW, grad_bucket_bytes=4096 * 4).grad_sync(small, (R,))
    assert c.seconds == pytest.approx(0.5 * 2 * 4096 / 1e10 + 0.25 * 2 * 1e-6)


def test_views_cost_nothing_and_inputs_need_no_gradient():
    cg = mlp_graph(64, 256, 32)
    facts = GraphFacts(cg, HW)
    for n in cg.gm.graph.nodes:
        if n.name in facts.views:
            assert facts.compute(n.name) == (0.0, 0.0)
    assert all(facts.kind[p] == "param" for p in cg.params)
    assert not any(facts.value_needs_grad(i, 0) for i in cg.inputs)


def test_a_dropout_that_returns_its_input_is_a_view():
    """``dropout(x, p=0)`` and eval-mode dropout return ``x`` itself (torch does, checked here); one
    with ``0 < p < 1`` in training makes a new tensor."""
    from autoshard.passes.capture.export import capture

    class Net(torch.nn.Module):
        def __init__(self, p: float):
            super().__init__()
            self.fc, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(p)

        def forward(self, x):
            return self.drop(torch.relu(self.fc(x)))

    x = torch.randn(4, 8, requires_grad=True)
    assert torch.dropout(x, 0.0, True) is x and torch.dropout(x, 0.5, False) is x
    for p, is_view in ((0.0, True), (0.5, False)):
        cg = capture(Net(p), (torch.randn(4, 8),), loss_fn=lambda out, t: (out - t).pow(2).mean(),
                     target=torch.randn(4, 8))
        facts = GraphFacts(cg, HW)
        drops = [n.name for n in cg.gm.graph.nodes if "dropout" in n.name]
        assert drops and all((d in facts.views) == is_view for d in drops)


def test_presets_cite_datasheet_values_and_load_from_json(tmp_path):
    assert PRESETS["a100"].flops_bf16 == 312e12 and PRESETS["a100"].flops_fp32 == 19.5e12
    assert PRESETS["h100"].flops_bf16 == 989e12 and PRESETS["h100"].memory_bandwidth == 3.35e12
    assert PRESETS["h200"].memory_bytes == 141e9 and PRESETS["h200"].flops_bf16 == PRESETS["h100"].flops_bf16
    assert PRESETS["h100"].intra_node_bandwidth == 450e9 and PRESETS["h100"].inter_node_bandwidth == 50e9
    assert PRESETS["h100"].peak_flops(torch.bfloat16) == 989e12
    assert PRESETS["h100"].peak_flops(torch.float32) == 67e12
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(HW.to_json()))
    assert get_hardware(str(path)) == HW
    assert Hardware.from_json(HW.to_json()) == HW
    assert get_hardware("H100") is PRESETS["h100"]
    with pytest.raises(AutoshardError, match="unknown field"):
        Hardware.from_json({**HW.to_json(), "nvlink": 1})
    with pytest.raises(AutoshardError, match="lacks field"):
        Hardware.from_json({"name": "x", "flops_bf16": 1.0})
    with pytest.raises(AutoshardError, match="unknown hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(AutoshardError, match="positive"):
        Hardware.from_json({**HW.to_json(), "memory_bandwidth": -1})
    assert math.isfinite(PRESETS["cpu"].intra_node_bandwidth)


def test_a_gradient_replicated_on_two_axes_is_all_reduced_once_over_both():
    """The runtime all-reduces such a gradient in one call over the axes flattened (one bucket per
    group of axes): with a measured fit for the flattened group it pays that fit's latency once,
    not one all-reduce per axis; without one, the axis-by-axis price is kept."""
    import dataclasses
    meta = TensorMeta((1024, 1024), torch.float32)
    fits = (("all_reduce", 2, 1e-3, 0.0), ("all_reduce", 4, 3e-3, 1e-9))
    hw = dataclasses.replace(get_hardware("cpu"), collective_fits=fits, op_overhead_s=0.0, devices_per_node=4)
    cm = CostModel(Mesh.of((2, 2)), hw, grad_bucket_bytes=meta.nbytes)
    (sync,) = cm.grad_sync(meta, (R, R))
    assert sync.seconds == pytest.approx(3e-3 + 1e-9 * meta.nbytes)   # the 4-rank fit, once
    plain = CostModel(Mesh.of((2, 2)), dataclasses.replace(hw, collective_fits=fits[:1]), grad_bucket_bytes=meta.nbytes)
    (sync,) = plain.grad_sync(meta, (R, R))
    assert sync.seconds == pytest.approx(2 * 1e-3)                     # no 4-rank fit: each axis in turn
