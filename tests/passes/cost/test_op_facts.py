"""Op facts live beside the op's rule (``passes/op_facts.py``, issue 29 item 4): a compute-bound op a
user registers with its rule, as ``docs/extension.md`` shows, is priced as compute by the cost model;
the same op registered without facts is memory-bound. No op is found by its name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.passes.capture.export import capture
from autoshard.passes.capture.saved import is_selective_save_op
from autoshard.passes.cost.facts import GraphFacts, matmul_flops
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.op_facts import OP_FACTS, OpFacts, op_facts
from autoshard.passes.sharding.rules import RULES, register_rule
from autoshard.passes.sharding.rules.matmul import einsum_strategies

H100 = PRESETS["h100"]
OP = "autoshard_test::gated_mm"


@torch.library.custom_op(OP, mutates_args=())
def gated_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` under a name no cost-model list could know."""
    return x @ w


@gated_mm.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[-1]))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(512, 1024))

    def forward(self, x):
        return gated_mm(x, self.w).sum()


def _priced(facts: OpFacts | None):
    """GraphFacts of ``_Model`` with ``gated_mm``'s rule registered (with ``facts`` if given), its node, and
    the FLOPs ``matmul_flops`` counts for it (while the rule is registered)."""
    def rule(call):
        return einsum_strategies(["mk", "kn"], "mn", [m.shape for m in call.inputs])
    register_rule(OP, facts=facts)(rule) if facts is not None else register_rule(OP)(rule)
    try:
        with torch.device("meta"):
            model = _Model()
        graph = GraphFacts(capture(model, (torch.empty(256, 512, device="meta"),)), H100)
        node = next(n for n, nd in graph.nodes.items() if nd.op == "call_function" and "gated_mm" in str(nd.target))
        return graph, node, matmul_flops(graph.nodes[node])
    finally:
        RULES.pop(OP)
        OP_FACTS.pop(OP, None)


def test_a_compute_bound_op_registered_with_its_rule_is_priced_as_compute():
    """The guide's example: ``register_rule("ns::op", facts=OpFacts(flops=..., gemm_operands=(0, 1)))`` in
    the rule's file, nothing else. The op is then a GEMM at its shape's achieved efficiency: forward
    ``2 M N K / peak / efficiency``, backward one GEMM for the weight (the input needs no gradient)."""
    flops = 2.0 * 256 * 1024 * 512
    graph, node, counted = _priced(OpFacts(flops=lambda call: 2.0 * call.outputs[0].numel * call.inputs[0].shape[-1],
                                  gemm_operands=(0, 1)))
    assert node not in graph.kernel_classes and node in graph.gemm_dims
    batch, m, n, k, itemsize, rank, eff = graph.gemm_dims[node]
    assert (batch, m, n, k, itemsize) == (1, 256, 1024, 512, 4)
    fwd, bwd = graph.compute(node)
    assert fwd == pytest.approx(flops / H100.peak_flops(torch.float32) / eff)
    assert bwd == pytest.approx(fwd)
    assert counted == flops
    # without its facts the same op (same rule) is a memory-bound kernel: the difference is the facts alone
    plain, node, counted = _priced(None)
    assert node in plain.kernel_classes and node not in plain.gemm_dims
    assert counted is None
    assert plain.compute(node)[0] != pytest.approx(fwd)


def test_the_builtin_facts_are_keyed_by_overload():
    """The matmul family and attention carry their facts by overload: compute-bound, GEMM shapes where a
    GEMM kernel runs, selective-save exactly on the dispatch-level kernels (not on ``linear``, which
    decomposes to ``mm`` before dispatch)."""
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.matmul.default, aten.linear.default, aten.einsum.default,
               aten.conv2d.default, aten.scaled_dot_product_attention.default):
        assert op_facts(op).compute_bound, op
    assert op_facts(aten.addmm.default).gemm_operands == (1, 2)
    assert not op_facts(aten.add.Tensor).compute_bound and not op_facts(aten.conv_transpose2d.input).compute_bound
    assert is_selective_save_op(aten.mm.default) and is_selective_save_op(aten._flash_attention_forward.default)
    assert not is_selective_save_op(aten.linear.default) and not is_selective_save_op(aten.add.Tensor)
