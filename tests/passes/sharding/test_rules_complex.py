"""Complex numbers: sizes, the rules of ``complex_views`` (and complex pointwise ops) checked against the
unsharded ops with complex operands and outputs, and a Llama whose rotary embedding multiplies
complex numbers planned without replicating its RoPE products."""
from __future__ import annotations

import pytest
import torch

from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.sharding.rules import RULES
from autoshard.passes.spec import Replicate, TensorMeta
from autoshard.testing.models import ComplexRopeLlama, lm_loss
from autoshard.testing.rule_numerics import check_rule_numerics, trace_calls, check_node

aten = torch.ops.aten


def test_complex_sizes():
    assert TensorMeta((4, 3), torch.complex64).nbytes == 96
    assert TensorMeta((4,), torch.complex128).nbytes == 64
    assert TensorMeta((4,), torch.bool).nbytes == 4
    assert TensorMeta((2,), torch.bfloat16).nbytes == 4


def _c(*shape):
    return torch.randn(*shape, dtype=torch.complex64)


CASES = {
    "view_as_complex": (torch.view_as_complex, (torch.randn(4, 8, 2),), {"(S(0))->(S(0))", "(S(1))->(S(1))", "(P)->(P)"}),
    "view_as_real": (torch.view_as_real, (_c(4, 8),), {"(S(0))->(S(0))", "(S(1))->(S(1))", "(P)->(P)"}),
    "real": (torch.real, (_c(4, 8),), {"(S(0))->(S(0))", "(P)->(P)"}),
    "imag": (torch.imag, (_c(4, 8),), {"(S(1))->(S(1))", "(P)->(P)"}),
    "conj": (lambda x: torch.conj_physical(x), (_c(4, 8),), {"(S(0))->(S(0))", "(P)->(P)"}),
    "angle": (torch.angle, (_c(4, 8),), {"(S(0))->(S(0))"}),
    "polar": (torch.polar, (torch.rand(4, 8), torch.randn(8)), {"(S(0), R)->(S(0))", "(S(1), S(0))->(S(1))"}),
    "complex": (torch.complex, (torch.randn(4, 8), torch.randn(4, 8)), {"(S(0), S(0))->(S(0))", "(P, P)->(P)"}),
    "complex mul": (torch.mul, (_c(4, 8), _c(8)), {"(S(1), S(0))->(S(1))", "(P, R)->(P)", "(R, P)->(P)"}),
    "complex add": (torch.add, (_c(4, 8), _c(4, 8)), {"(S(0), S(0))->(S(0))", "(P, P)->(P)"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [2, 4])
def test_complex_rules_match_unsharded(name, n):
    fn, args, expected = CASES[name]
    report = check_rule_numerics(fn, args, n=n)
    assert expected <= report.all_str, report.all_str
    assert report.checked_str == report.all_str, report.skipped
    if name in ("view_as_complex",):  # the (real, imaginary) pair is never split
        assert "(S(2))->(S(2))" not in report.all_str


def test_every_op_of_metas_rotary_embedding_is_checked():
    """Meta's apply_rotary_emb, traced: every op has a rule, and every strategy matches the unsharded op
    on 2 and 4 ranks, gradients included."""
    from autoshard.testing.models import _freqs_cis, _rotate
    x, freqs = torch.randn(4, 8, 4, 16), _freqs_cis(16, 8)
    gm, calls = trace_calls(_rotate, (x, freqs))
    targets = {node.target for node in calls}
    assert {aten.view_as_complex.default, aten.view_as_real.default, aten.mul.Tensor} <= targets
    for node, (args, kwargs) in calls.items():
        for n in (2, 4):
            report = check_node(node, args, kwargs, n)
            if node.target in (aten.view_as_complex.default, aten.mul.Tensor, aten.view_as_real.default):
                assert any("S(1)" in s for s in report.checked_str), (node, report.all_str)


def _rope_nodes(cg) -> list[str]:
    """The RoPE products: complex views of activations, their products with freqs_cis, and back."""
    found = []
    for n in cg.gm.graph.nodes:
        if n.target in (aten.view_as_complex.default, aten.view_as_real.default):
            found.append(n.name)
        elif n.target == aten.mul.Tensor and n.meta["autoshard.meta"].dtype.is_complex:
            found.append(n.name)
    return found


def test_complex_rope_llama_plans_without_replicated_rope(monkeypatch):
    """Llama-3-8B-wide layers (2 of them) at sequence 8192 on an (8, 8) H100 mesh: no op lacks a rule,
    no RoPE product is replicated, and the plan needs less memory than with the complex views unruled."""
    with torch.device("meta"):
        model = ComplexRopeLlama(vocab=128256, d=4096, n_layer=2, n_head=32, n_kv_head=8, seq=8192)
    ids = torch.empty(8, 8192, dtype=torch.long, device="meta")
    cg = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    rope = _rope_nodes(cg)
    assert len(rope) == 2 * 2 * 3  # per layer: q and k each view_as_complex, mul, view_as_real
    plan = plan_captured(cg, (8, 8), hardware="h100", memory_limit=80 * 2 ** 30)
    assert plan.replicated_ops == []
    replicated = [n for n in rope if all(isinstance(p, Replicate) for p in plan.strategies[n].outputs[0])]
    assert not replicated

    for op in (aten.view_as_complex.default, aten.view_as_real.default):
        monkeypatch.delitem(RULES, op)
    unruled = plan_captured(cg, (8, 8), hardware="h100", memory_limit=80 * 2 ** 30)
    assert sorted(unruled.replicated_ops) == ["aten.view_as_complex.default", "aten.view_as_real.default"]
    additive = lambda p: sum(p.solution.memory_breakdown.values())  # noqa: E731 (what estimated_memory was before the peak)
    # 1.44x with this session's pricing (GEMMs of every shape, fused and flat gathers), 1.5x before
    assert additive(unruled) > 1.3 * additive(plan)
    assert unruled.estimated_memory > plan.estimated_memory  # and the step's peak (the logits weigh on both)


def test_the_cost_model_knows_complex_values_carry_gradients():
    """The RoPE products are differentiable: their redistributions are priced with a backward."""
    from autoshard.passes.cost.facts import GraphFacts
    from autoshard.passes.cost.hardware_lookup import get_hardware
    from autoshard.testing.models import complex_rope_llama
    model, inputs, target, loss_fn = complex_rope_llama()
    cg = capture(model, inputs, loss_fn=loss_fn, target=target)
    facts = GraphFacts(cg, get_hardware("h100"))
    rope = _rope_nodes(cg)
    assert rope and all(n in facts.requires_grad for n in rope)
    assert all(facts.value_needs_grad(n, 0) for n in rope)
