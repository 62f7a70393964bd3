"""The ops of Hugging Face MoE experts: ``_grouped_mm`` in its four forms, transformers'
``grouped_mm_fallback`` custom op, ``histc`` and ``repeat_interleave``. Every strategy a rule claims
matches the unsharded op on 2 and 4 simulated ranks, gradients included; what is documented as not
offered (splitting a dim the offsets cut, splitting a 2d x 3d product's groups) is absent.

``_grouped_mm`` traces only in bfloat16 (its meta function says so) but runs on the CPU in float32
too: each case is traced in bfloat16 and checked on float32 values of the same shapes (the rule
reads shapes only), so the comparison keeps float32's tolerance. Every last dim is a multiple of 32
so that the kernel's 16-byte stride alignment holds after a split by 4."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.testing.rule_numerics import RuleCheck, check_node, check_rule_numerics, trace_op


@pytest.fixture(autouse=True)
def _seeded():
    """The tests draw their data from torch's global generator: seed it, so a test's data (and its
    rounding against the tolerance) does not depend on which tests ran before it in the process."""
    torch.manual_seed(0)

aten = torch.ops.aten
OFFS = torch.tensor([8, 16, 32], dtype=torch.int32)  # uneven groups: 8, 8 and 16


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def _gmm(a, b, offs=None):
    return torch._grouped_mm(a, b, offs=offs)


def check_in_float32(fn, args, n: int) -> RuleCheck:
    """Trace ``fn`` on ``args`` (bfloat16) and check its ``_grouped_mm`` on the same values in float32."""
    node, real_args, kwargs = trace_op(fn, args, target=aten._grouped_mm.default)
    wide = tuple(a.float() if a.is_floating_point() else a for a in real_args)
    return check_node(node, wide, kwargs, n, gen=torch.Generator().manual_seed(0))


FORMS = {
    # name: (args, strategies that must be offered, strategies that must not)
    "2d x 3d": ((_bf16(32, 32), _bf16(3, 32, 32), OFFS),
                {"(R, S(2), R)->(S(1))", "(S(1), S(1), R)->(P)", "(P, R, R)->(P)", "(R, P, R)->(P)"},
                {"(S(0), R, R)->(S(0))", "(R, S(0), R)->(S(0))"}),
    "3d x 3d": ((_bf16(4, 32, 32), _bf16(4, 32, 32)),
                {"(S(0), S(0))->(S(0))", "(S(1), R)->(S(1))", "(R, S(2))->(S(2))", "(S(2), S(1))->(P)"}, set()),
    "3d x 2d": ((_bf16(3, 32, 32), _bf16(32, 32), OFFS),
                {"(S(1), R, R)->(S(0))", "(S(2), S(0), R)->(P)"}, {"(R, S(1), R)->(S(1))"}),
    "2d x 2d": ((_bf16(32, 32), _bf16(32, 32), OFFS),
                {"(S(0), R, R)->(S(1))", "(R, S(1), R)->(S(2))"}, {"(S(1), S(0), R)->(P)"}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("n", [2, 4])
def test_grouped_mm_forms_match_unsharded(form, n):
    args, offered, absent = FORMS[form]
    report = check_in_float32(_gmm, args, n)
    assert offered <= report.all_str, report.all_str
    assert not absent & report.all_str
    assert report.checked_str == report.all_str, report.skipped


def test_grouped_mm_weight_given_transposed():
    """HF passes ``weight.transpose(-2, -1)`` of (G, N, K) expert weights: a column-major operand."""
    w = _bf16(3, 32, 32)
    report = check_in_float32(lambda a, w, offs: _gmm(a, w.transpose(-2, -1), offs), (_bf16(32, 32), w, OFFS), 2)
    assert "(R, S(2), R)->(S(1))" in report.checked_str


def test_transformers_grouped_mm_fallback_custom_op():
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
    op = torch.ops.transformers.grouped_mm_fallback.default
    report = check_rule_numerics(lambda a, w, offs: op(a, w, offs), (torch.randn(32, 8), torch.randn(3, 8, 16), OFFS),
                                 n=2, target=op)
    assert {"(R, S(2), R)->(S(1))", "(S(1), S(1), R)->(P)"} <= report.checked_str


def test_histc_with_a_fixed_range_gives_partial_counts():
    ids = torch.randint(0, 4, (8, 2)).float()
    report = check_rule_numerics(lambda x: torch.histc(x, bins=4, min=0, max=3), (ids,), n=4)
    assert report.checked_str == {"(R)->(R)", "(S(0))->(P)"}
    report = check_rule_numerics(lambda x: torch.histc(x, bins=4), (ids,), n=2)  # range from the data
    assert report.all_str == {"(R)->(R)"}


def test_repeat_interleave_splits_every_dim():
    report = check_rule_numerics(lambda x: x.repeat_interleave(2, dim=0), (torch.randn(8, 4),), n=4)
    assert report.checked_str == {"(R)->(R)", "(S(0))->(S(0))", "(S(1))->(S(1))", "(P)->(P)"}


def test_bf16_mixtral_experts_trace_to_grouped_mm_and_shard_by_its_rule():
    """transformers' grouped-GEMM experts in bfloat16 call ``aten._grouped_mm`` (float32 under export takes
    the library's fallback op instead): no op lacks a rule, and experts pinned column-split on the
    second mesh axis keep their products split there (no gather of the expert weights)."""
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM

    from autoshard.api import plan_captured
    from autoshard.passes.capture.export import capture
    from autoshard.testing.models import hf_lm_loss as lm_loss

    config = MixtralConfig(num_hidden_layers=1, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
                           use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty(8, 64, dtype=torch.long, device="meta")
    cg = capture(model, {"input_ids": ids}, loss_fn=lm_loss, target=ids, fuse_experts=False)  # experts as written
    gmm = [n.name for n in cg.gm.graph.nodes if n.target == aten._grouped_mm.default]
    assert len(gmm) == 2  # gate_up and down projections
    pins = {"params": {"*experts.gate_up_proj": ("R", "S(1)"), "*experts.down_proj": ("R", "S(2)")}}
    plan = plan_captured(cg, (2, 2), hardware="h100", pins=pins)
    assert plan.replicated_ops == []
    gate_up, down = (plan.strategies[n] for n in gmm)
    assert tuple(gate_up.inputs[1]) == (Replicate(), Shard(2))  # N of the (G, K, N) operand: the weight's rows
    assert tuple(gate_up.outputs[0])[1] == Shard(1)
    assert tuple(down.inputs[1])[1] == Shard(1)  # K of the down projection: partial sums
    assert tuple(down.outputs[0])[1] == Partial()


def test_splits_that_break_the_kernels_stride_alignment_are_not_offered():
    """A (G, K, N) float32 operand with N = 16: split in 2, pieces of 8 floats (32 bytes) are fine; split
    in 8, pieces of 2 floats (8 bytes) would fail the kernel's 16-byte alignment, so the mesh strategy
    is dropped (and the harness skips it for the same reason)."""
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.sharding.strategies import enumerate_strategies
    from autoshard.passes.capture.export import capture

    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (registers the op)
    op = torch.ops.transformers.grouped_mm_fallback.default

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 8, 16))

        def forward(self, x):
            return op(x, self.w, OFFS)

    cg = capture(Experts(), (torch.randn(32, 8),))
    node = next(n.name for n in cg.gm.graph.nodes if n.target == op)
    n_split = lambda mesh: {str(s) for s in enumerate_strategies(cg, Mesh.of(mesh))[node]}  # noqa: E731
    assert "[(R),(S(2)),(R)]->[(S(1))]" in n_split((2,))
    assert "[(R),(S(2)),(R)]->[(S(1))]" not in n_split((8,))
    report = check_rule_numerics(lambda x, w, offs: op(x, w, offs), (torch.randn(32, 8), torch.randn(3, 8, 16), OFFS),
                                 n=8, target=op, rtol=1e-4, atol=1e-4)  # R gradients: sums of 8 summands
    assert "(R, S(2), R)->(S(1))" in {str(s) for s, why in report.skipped if "local check" in why}
