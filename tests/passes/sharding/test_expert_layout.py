"""Expert-parallel layouts on the planner side (issue 28 item 3): the folding arithmetic
(``passes/sharding/expert_layout.fold_axes``), the planning mesh of ``megatron(ep=, etp=)`` /
``fsdp(ep=)``, and the placements ``autoshard.plan(layout=...)`` pins on tiny meta-device Hugging Face
MoE models: experts split over ep, inside each expert over etp, the router replicated over tp, and
every block's attention tensor-parallel (the MoE layer's output is whole, as a row-parallel layer's).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import autoshard  # noqa: E402
from autoshard import layouts  # noqa: E402
from autoshard.layouts import LayoutError  # noqa: E402
from autoshard.passes.sharding.expert_layout import fold_axes  # noqa: E402
from autoshard.passes.spec import Partial, Replicate, Shard  # noqa: E402
from autoshard.testing.hf_zoo import ZOO  # noqa: E402

R, P, S0, S1, S2 = Replicate(), Partial(), Shard(0), Shard(1), Shard(2)


def test_fold_cuts_the_ranks_where_either_group_starts():
    f = fold_axes(tp=2, cp=1, dp=32, ep=8, etp=1)  # Megatron-Core's folding: EP 8 over TP 2 x 4 dp ranks
    assert f.shape == (8, 4, 2) and f.attention == ("dp", "dp", "tp") and f.experts == ("edp", "ep", "ep")
    f = fold_axes(tp=8, cp=1, dp=16, ep=4)  # etp = tp: EP inside dp, each expert tensor-parallel over tp
    assert f.shape == (4, 4, 8) and f.experts == ("edp", "ep", "etp")
    f = fold_axes(tp=1, cp=2, dp=4, ep=8, etp=1)  # EP over dp and cp together
    assert f.without_ones().shape == (4, 2) and f.without_ones().experts == ("ep", "ep")
    assert fold_axes(tp=2, cp=1, dp=4).names == ("dp", "tp")  # no expert groups: the attention's axes
    f = fold_axes(tp=1, cp=1, dp=8, ep=2, replicas=2)  # HSDP: the replica groups stay slowest, whole
    assert f.without_ones().shape == (2, 2, 2) and f.without_ones().experts == ("replica", "edp", "ep")


def test_fold_names_what_does_not_fit():
    with pytest.raises(LayoutError, match=r"ep x etp = 3 x 1 = 3 does not divide the 8 ranks"):
        fold_axes(tp=2, cp=1, dp=4, ep=3, etp=1)
    with pytest.raises(LayoutError, match=r"do not nest: group boundaries at 2 and 3"):
        fold_axes(tp=2, cp=1, dp=6, ep=3, etp=1)
    with pytest.raises(LayoutError, match=r"would cut the 4 tp ranks into 2 axes"):
        fold_axes(tp=4, cp=1, dp=2, ep=2, etp=1)


def _plan(name: str, layout, mesh=4):
    torch.manual_seed(0)
    with torch.device("meta"):
        model, inputs, target, loss_fn = ZOO[name]()
    return autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="h100", layout=layout, time_limit_s=5)


def _moe(plan) -> list:
    return [st for n, st in plan.solution.strategies.items() if n.startswith("moe_experts")]


def test_megatron_folds_expert_parallel_into_the_tensor_parallel_ranks():
    plan = _plan("mixtral", layouts.megatron(tp=2, ep=2, etp=1, recompute="none"))
    assert plan.mesh.axis_names == ("dp_edp", "tp_ep") and plan.mesh.shape == (2, 2)
    pls = plan.param_placements
    for layer in (0, 1):
        pre = f"model.layers.{layer}."
        assert tuple(pls[pre + "mlp.experts.gate_up_proj"]) == (R, S0)
        assert tuple(pls[pre + "mlp.experts.down_proj"]) == (R, S0)
        assert tuple(pls[pre + "mlp.gate.weight"]) == (R, R)  # the router, whole on every tp rank
        assert tuple(pls[pre + "self_attn.q_proj.weight"]) == (R, S0)  # every block tensor-parallel
        assert tuple(pls[pre + "self_attn.o_proj.weight"]) == (R, S1)
    moe = _moe(plan)
    assert len(moe) == 2
    for st in moe:  # tokens split over dp and (sequence parallel) tp, dispatched over the tp ranks
        assert st.inputs[0] == (S0, S0) and st.inputs[3] == (R, S0) and st.outputs[0] == (S0, S0)
        assert st.lowerings == (None, "expert_dispatch")


def test_megatron_expert_tensor_parallel_and_distributed_optimizer():
    plan = _plan("mixtral", layouts.megatron(tp=2, ep=2, recompute="none", distributed_optimizer=True))
    assert plan.mesh.axis_names == ("dp_ep", "tp_etp")
    pls = plan.param_placements
    assert tuple(pls["model.layers.1.mlp.experts.gate_up_proj"]) == (S0, S1)
    assert tuple(pls["model.layers.1.mlp.experts.down_proj"]) == (S0, S2)
    for st in _moe(plan):  # tokens gathered over tp, each expert's I split there: a partial output
        assert st.inputs[0] == (S0, R) and st.inputs[3] == (S0, S1) and st.inputs[5] == (S0, S2)
        assert st.outputs[0] == (S0, P) and st.lowerings == ("expert_dispatch", None)


def test_fsdp_expert_parallel_shards_the_experts_over_the_rest():
    plan = _plan("qwen2_moe", layouts.fsdp(ep=2))
    assert plan.mesh.axis_names == ("dp_edp", "dp_ep")
    pls = plan.param_placements
    assert tuple(pls["model.layers.1.mlp.experts.gate_up_proj"]) == (S1, S0)  # FSDP on a dim ep does not split
    assert tuple(pls["model.layers.1.mlp.shared_expert.up_proj.weight"]) == (S0, S0)
    assert tuple(pls["model.layers.1.self_attn.q_proj.weight"]) == (S0, S0)
    for st in _moe(plan):
        assert st.inputs[0] == (S0, S0) and st.inputs[3] == (R, S0) and st.lowerings == (None, "expert_dispatch")


def test_megatron_tensor_parallel_reaches_every_block_of_a_moe_model():
    """Before the router was recognised, its column-parallel guess and the MoE output's mix of roles made
    every block after the first 'mixed': layer 1's attention was left replicated over tp."""
    for name in ("mixtral", "qwen2_moe"):
        plan = _plan(name, layouts.megatron(tp=2, recompute="none"), mesh=(2, 2))
        pls = plan.param_placements
        for layer in (0, 1):
            assert tuple(pls[f"model.layers.{layer}.self_attn.q_proj.weight"]) == (R, S0), (name, layer)
            assert tuple(pls[f"model.layers.{layer}.self_attn.o_proj.weight"]) == (R, S1), (name, layer)
            # no ep: the experts split inside over tp (etp = tp), data parallel over dp
            assert tuple(pls[f"model.layers.{layer}.mlp.experts.down_proj"]) == (R, S2), (name, layer)
        assert all(st.lowerings == (None, None) and st.inputs[3] == (R, S1) for st in _moe(plan)), name


def test_pipelined_expert_parallel_layout_gets_a_folded_submesh():
    plan = _plan("mixtral", layouts.megatron(pp=2, ep=2, recompute="none"))
    assert plan.pp == 2 and [s.mesh.shape for s in plan.stages] == [(2, 1), (2, 1)]
    moe = [st for s in plan.stages for n, st in s.solution.strategies.items() if n.startswith("moe_experts")]
    assert moe and all(st.lowerings[0] == "expert_dispatch" for st in moe)
