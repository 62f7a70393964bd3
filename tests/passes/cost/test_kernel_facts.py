"""A memory-bound op is priced by the ``OpFacts`` registered for it (kernel class, byte rule, view), keyed
by the op as its rule is, never by its name (issue 29 item 4): a custom op whose name an ATen norm shares
is an elementwise op until facts say otherwise, and a custom op registered as a norm is priced as one."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.kernel_classes import CLASS_RATIO
from autoshard.passes.op_facts import OP_FACTS, OpFacts, register_facts

H100 = PRESETS["h100"]


def _custom(name: str):
    @torch.library.custom_op(f"autoshard_kf::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @op.register_fake
    def _(x):
        return torch.empty_like(x)
    return op


my_norm, layer_norm, my_alias = _custom("my_norm"), _custom("layer_norm"), _custom("my_alias")


class _Model(nn.Module):
    def forward(self, x):
        return (my_norm(x) + layer_norm(x) + my_alias(x)).sum()


def _node(facts: GraphFacts, name: str) -> str:
    return next(n for n, node in facts.nodes.items() if node.op == "call_function"
                and getattr(node.target, "__name__", "").startswith(name))


def _rate(cls: str) -> float:
    return H100.memory_bandwidth * H100.memory_efficiency * CLASS_RATIO[cls]


def test_custom_ops_are_priced_by_their_facts_not_their_names():
    nbytes = 256 * 256 * 4
    register_facts("autoshard_kf::my_norm", facts=OpFacts(
        kernel_class="norm", memory_bytes=lambda node, ins, outs: (3.0 * ins[0].nbytes, 5.0 * ins[0].nbytes)))
    register_facts("autoshard_kf::my_alias", facts=OpFacts(view=True))
    try:
        with torch.device("meta"):
            model = _Model()
        facts = GraphFacts(capture(model, (torch.empty(256, 256, device="meta"),)), H100)
        norm, named, alias = _node(facts, "my_norm"), _node(facts, "layer_norm"), _node(facts, "my_alias")
        assert facts.kernel_classes[norm] == "norm"
        assert facts.compute(norm)[0] == pytest.approx(3 * nbytes / _rate("norm"))
        # named like ATen's layer_norm, registered nowhere: a plain elementwise op moving its operand + output
        assert facts.kernel_classes[named] == "elementwise"
        assert facts.compute(named)[0] == pytest.approx(2 * nbytes / _rate("elementwise"))
        assert alias in facts.views and facts.compute(alias) == (0.0, 0.0) and facts.launches(alias) == 1
    finally:
        OP_FACTS.pop("autoshard_kf::my_norm")
        OP_FACTS.pop("autoshard_kf::my_alias")
