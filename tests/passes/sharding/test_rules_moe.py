"""The ``autoshard::moe_experts`` op (``passes/capture/moe_experts.py``) and its rule (``rules/moe.py``):
the fused op equals transformers' own experts code, data and tensor parallel strategies hold numerically
on simulated ranks (expert parallel needs collectives: tests/runtime/test_moe_expert_parallel.py), and
capture fuses the HF MoE models' experts and leaves ``batched_mm`` ones as written."""
from __future__ import annotations

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.capture.moe_experts import fused_experts, moe_experts
from autoshard.testing.rule_numerics import check_rule_numerics

pytest.importorskip("transformers")

from autoshard.testing.hf_zoo import build  # noqa: E402
from autoshard.testing.moe_check import moe_nodes  # noqa: E402


def _args(tokens=8, hidden=6, inter=4, experts=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    gate, up = torch.randn(experts, inter, hidden, generator=g), torch.randn(experts, inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    return x, index, weights, gate, up, down


def test_data_and_tensor_parallel_strategies_hold_numerically():
    report = check_rule_numerics(lambda *a: moe_experts(*a, "silu"), _args(), n=2)
    checked = report.checked_str
    assert "(S(0), S(0), S(0), R, R, R)->(S(0))" in checked
    assert "(R, R, R, S(1), S(1), S(2))->(P)" in checked
    assert {str(s) for s, _ in report.skipped} == {"(S(0), S(0), S(0), S(0), S(0), S(0))->(S(0))[expert_dispatch]",
                                                  "(R, R, R, S(0), S(0), S(0))->(P)[expert_dispatch]"}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_experts_equal_the_models_own_code(name):
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build(name)
    want = loss_fn(model(**inputs), target)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with fused_experts(model) as paths:
        got = loss_fn(model(**inputs), target)
        got.backward()
    assert paths and all(p.endswith("mlp.experts") for p in paths)
    assert "forward" not in model.get_submodule(paths[0]).__dict__  # restored
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_capture_fuses_grouped_mm_experts_but_not_batched_mm():
    torch.manual_seed(0)
    for name, layers in (("mixtral", 2), ("mixtral_batched", 0)):
        model, inputs, target, loss_fn = build(name)
        assert len(moe_nodes(capture(model, inputs, loss_fn=loss_fn, target=target))) == layers
    model, inputs, target, loss_fn = build("mixtral")
    assert moe_nodes(capture(model, inputs, loss_fn=loss_fn, target=target, fuse_experts=False)) == []


def _dropping_reference(x, index, weights, gate, up, down, capacity):
    """Brute force: pairs in token order; an expert keeps its first ``capacity`` pairs."""
    out = torch.zeros_like(x)
    taken = [0] * gate.shape[0]
    for t in range(index.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if taken[e] < capacity:
                taken[e] += 1
                h = torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])
                out[t] += weights[t, j] * (down[e] @ h)
    return out


def test_capacity_factor_drops_pairs_beyond_capacity_in_token_order():
    from autoshard.passes.capture.moe_experts import capacity_rows
    x, index, weights, gate, up, down = (t.double() if t.is_floating_point() else t for t in _args(tokens=12))
    exact = moe_experts(x, index, weights, gate, up, down, "silu")
    assert torch.allclose(moe_experts(x, index, weights, gate, up, down, "silu", 4.0), exact)  # C = T k: no drop
    cap = capacity_rows(index.numel(), gate.shape[0], 0.5)
    assert cap == 3
    got = moe_experts(x, index, weights, gate, up, down, "silu", 0.5)
    want = _dropping_reference(x, index, weights, gate, up, down, cap)
    assert torch.allclose(got, want) and not torch.allclose(got, exact)
    xg = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: moe_experts(v, index, weights, gate, up, down, "silu", 0.5), (xg,))


def test_a_capacity_factor_makes_expert_parallel_the_static_lowering():
    args = _args()
    for factor, lowering in ((0.0, "expert_dispatch"), (1.25, "expert_dispatch_capacity")):
        report = check_rule_numerics(lambda *a: moe_experts(*a, "silu", factor), args, n=2)
        assert {s.lowering for s in report.strategies} == {None, lowering}
        assert len(report.checked) == 3  # replicated, data and tensor parallel: the op itself on local pieces


def test_set_moe_capacity_factor_reaches_the_captured_op():
    import autoshard
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build("mixtral")
    assert len(autoshard.set_moe_capacity_factor(model, 1.5)) == 2
    cg = capture(model, inputs, loss_fn=loss_fn, target=target)
    nodes = [n for n in cg.gm.graph.nodes if n.name in moe_nodes(cg)]
    assert [n.args[7] for n in nodes] == [1.5, 1.5]
    with pytest.raises(ValueError, match="finite number >= 0"):
        autoshard.set_moe_capacity_factor(model, -1)
