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
    want = loss_fn(model(**inputs).logits, target)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with fused_experts(model) as paths:
        got = loss_fn(model(**inputs).logits, target)
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
