"""Strategy enumeration: every node covered, all-replicated first, divisibility, size-1 axes, caps."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from autoshard.passes.capture.export import capture
from autoshard.passes.graph import operand_meta, operands, outputs
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Replicate, Shard, Strategy
from autoshard.passes.sharding.strategies import divides, enumerate_strategies, placeholder_strategies, unruled_ops
from autoshard.testing.graphs import gpt_graph, mlp_graph


def _tensor_metas(node):
    if node.op == "placeholder":
        return [], [m for m in outputs(node) if m is not None]
    return [operand_meta(o) for o in operands(node)], [m for m in outputs(node) if m is not None]


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_every_node_has_valid_strategies_all_replicated_first(shape):
    mesh = Mesh.of(shape)
    cg = gpt_graph(2)
    table = enumerate_strategies(cg, mesh)
    nodes = [n for n in cg.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    assert set(table) == {n.name for n in nodes}
    for n in nodes:
        ins, outs = _tensor_metas(n)
        strategies = table[n.name]
        assert strategies, n.name
        first = strategies[0]
        assert all(p == Replicate() for pls in (*first.inputs, *first.outputs) for p in pls), (n.name, first)
        seen = set()
        for s in strategies:
            assert len(s.inputs) == len(ins) and len(s.outputs) == len(outs), (n.name, s)
            for metas, plss in ((ins, s.inputs), (outs, s.outputs)):
                for m, pls in zip(metas, plss):
                    assert len(pls) == mesh.ndim
                    assert divides(m.shape, pls, mesh), (n.name, str(s), m.shape)
            key = (s.inputs, s.outputs)
            assert key not in seen, f"duplicate strategy {s} at {n.name}"
            seen.add(key)


def test_divisibility_filter_on_parameters_and_ops():
    cg = mlp_graph(6, 10, 12)  # fc1.weight (10, 6), fc2.weight (6, 10), batch 12
    w1 = next(k for k, v in cg.params.items() if v == "fc1.weight")
    on4 = enumerate_strategies(cg, Mesh.of(4))
    assert [s.outputs[0] for s in on4[w1]] == [(Replicate(),)]  # neither 10 nor 6 divides by 4
    on22 = {s.outputs[0] for s in enumerate_strategies(cg, Mesh.of((2, 2)))[w1]}
    expected = {pls for pls in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)
                if divides((10, 6), pls, Mesh.of((2, 2)))}
    assert on22 == expected
    assert (Shard(0), Replicate()) in on22 and (Shard(0), Shard(0)) not in on22  # 10 % 4 != 0
    # the batch (12) splits over 4, and so does the first linear's output rows
    x = cg.inputs[0]
    assert (Shard(0),) in {s.outputs[0] for s in on4[x]}
    linear = next(n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    outs = {s.outputs[0] for s in on4[linear.name]}
    assert (Shard(0),) in outs and (Shard(1),) not in outs  # 10 hidden features do not split 4 ways


def test_placeholder_strategies_enumerate_R_and_every_dividing_shard():
    from autoshard.passes.spec import TensorMeta
    mesh = Mesh.of((2, 2))
    got = [s.outputs[0] for s in placeholder_strategies(TensorMeta((8, 6), torch.float32), mesh)]
    assert got[0] == (Replicate(), Replicate())
    want = {(a, b) for a in (Replicate(), Shard(0), Shard(1)) for b in (Replicate(), Shard(0), Shard(1))}
    want.discard((Shard(1), Shard(1)))  # 6 does not divide by 4
    assert set(got) == want and len(got) == len(want)


def test_axes_of_size_one_only_replicate():
    cg = mlp_graph(16, 32, 8)
    flat = enumerate_strategies(cg, Mesh.of(4))
    padded = enumerate_strategies(cg, Mesh.of((1, 4)))
    for name, strategies in padded.items():
        for s in strategies:
            assert all(pls[0] == Replicate() for pls in (*s.inputs, *s.outputs)), (name, s)
        assert len(strategies) == len(flat[name]), name


def test_matmul_rule_strategies_reach_the_table():
    cg = mlp_graph(16, 32, 8)
    table = enumerate_strategies(cg, Mesh.of((2, 2)))
    linear = next(n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    column = ((R, R), (R, S0), (R, S0))  # x replicated, weight and bias split by output features on axis 1
    dp = ((S0, S0), (R, R), (R, R))
    got = {s.inputs: s.outputs for s in table[linear.name]}
    assert got.get(column) == ((R, S1),)
    assert got.get(dp) == ((S0, S0),)
    assert linear.name not in table.unruled


def test_cap_keeps_all_replicated_and_bounds_every_node():
    cg = gpt_graph(1)
    full = enumerate_strategies(cg, Mesh.of((2, 2)))
    capped = enumerate_strategies(cg, Mesh.of((2, 2)), max_per_node=3)
    for name, strategies in capped.items():
        assert 1 <= len(strategies) <= 3
        assert strategies[0] == full[name][0]
        assert all(s in full[name] for s in strategies)
    assert any(len(v) > 3 for v in full.values())


def test_ops_without_a_rule_are_recorded_and_run_replicated():
    lib = torch.library.Library("autoshard_test_strat", "DEF")  # noqa: F841 (kept alive for the test)
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    lib.impl("twice", lambda x: torch.empty_like(x), "Meta")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.autoshard_test_strat.twice(self.fc(x))

    with torch.device("meta"):
        model = Twice()
    cg = capture(model, (torch.empty(4, 8, device="meta"),))
    table = enumerate_strategies(cg, Mesh.of(2))
    node = next(n for n in cg.gm.graph.nodes if "twice" in str(n.target))
    assert table.unruled == {node.name: str(node.target)}
    assert len(table[node.name]) == 1
    assert unruled_ops(cg) == table.unruled


def test_identical_layers_get_identical_lists():
    cg = gpt_graph(3)
    table = enumerate_strategies(cg, Mesh.of((2, 2)))
    per_layer = {}
    for n in cg.gm.graph.nodes:
        path = n.meta.get("autoshard.module", "")
        if n.op == "call_function" and path.startswith("blocks."):
            layer = path.split(".")[1]
            per_layer.setdefault(layer, []).append([str(s) for s in table[n.name]])
    assert len(per_layer) == 3
    assert per_layer["0"] == per_layer["1"] == per_layer["2"]
    assert all(isinstance(s, Strategy) for v in table.values() for s in v)
