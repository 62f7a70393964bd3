"""Sharding rules, part A: matmul, embedding, norms, attention, losses, conv.

Every case traces a tiny function around one op and runs ``check_rule_numerics`` (autoshard/testing/rule_numerics.py):
each strategy the registry offers is simulated on n ranks in one process and compared with the
unsharded op, forward and gradients. The ``expect`` list names strategies the rule must offer
(and that then passed the check). Strategies with the lowering "batch_norm_sync" are the only
ones skipped: their math needs collectives, so the runtime tests them on real ranks.
"""
from __future__ import annotations

import operator
import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from autoshard.passes.graph import META, tensor_meta_of
from autoshard.passes.op_facts import OP_FACTS, find_registered
from autoshard.passes.sharding import rules as rules_package
from autoshard.passes.sharding.rules import FAMILIES, RULES, lookup, rule_strategies
from autoshard.passes.sharding.rules.matmul import einsum_strategies, parse_einsum
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.testing.rule_numerics import check_rule_numerics

aten = torch.ops.aten
D = torch.float64
RULES_DIR = Path(rules_package.__file__).parent
PART_A = ["matmul.py", "embedding.py", "norms.py", "attention.py", "losses.py", "conv.py"]


def rn(*shape):
    return torch.randn(*shape, dtype=D)


def pos(*shape):
    return torch.rand(*shape, dtype=D) + 0.5


def labels(high, *shape):
    return torch.randint(0, high, shape)


def sdpa(**kw):
    return lambda q, k, v, *m: F.scaled_dot_product_attention(q, k, v, *m, **kw)


# id -> (fn, args, kwargs, n, strategies the rule must offer and the check must pass)
CASES = {
    "mm": (torch.mm, lambda: (rn(4, 6), rn(6, 8)), {}, 2,
           ["(S(0), R)->(S(0))", "(S(1), S(0))->(P)", "(R, S(1))->(S(1))", "(P, R)->(P)", "(R, P)->(P)"]),
    "mm_n3": (torch.mm, lambda: (rn(3, 6), rn(6, 9)), {}, 3,
              ["(S(0), R)->(S(0))", "(S(1), S(0))->(P)", "(R, S(1))->(S(1))"]),
    "addmm_bias_row": (torch.addmm, lambda: (rn(8), rn(4, 6), rn(6, 8)), {"beta": 0.5, "alpha": 2.0}, 2,
                       ["(R, S(0), R)->(S(0))", "(P, S(1), S(0))->(P)", "(S(0), R, S(1))->(S(1))",
                        "(P, P, R)->(P)", "(P, R, P)->(P)"]),
    "addmm_bias_full": (torch.addmm, lambda: (rn(4, 8), rn(4, 6), rn(6, 8)), {}, 2,
                        ["(S(0), S(0), R)->(S(0))", "(S(1), R, S(1))->(S(1))"]),
    "bmm": (torch.bmm, lambda: (rn(2, 4, 6), rn(2, 6, 8)), {}, 2,
            ["(S(0), S(0))->(S(0))", "(S(1), R)->(S(1))", "(S(2), S(1))->(P)", "(R, S(2))->(S(2))"]),
    "baddbmm": (torch.baddbmm, lambda: (rn(1, 4, 8), rn(2, 4, 6), rn(2, 6, 8)), {"beta": 0.3}, 2,
                ["(R, S(0), S(0))->(S(0))", "(S(1), S(1), R)->(S(1))", "(P, S(2), S(1))->(P)"]),
    "matmul_3d_2d": (torch.matmul, lambda: (rn(2, 4, 6), rn(6, 8)), {}, 2,
                     ["(S(0), R)->(S(0))", "(S(1), R)->(S(1))", "(S(2), S(0))->(P)", "(R, S(1))->(S(2))"]),
    "matmul_broadcast_batch": (torch.matmul, lambda: (rn(2, 1, 4, 6), rn(2, 6, 8)), {}, 2,
                               ["(S(0), R)->(S(0))", "(R, S(0))->(S(1))", "(S(3), S(1))->(P)"]),
    "matmul_vec_mat": (torch.matmul, lambda: (rn(6), rn(6, 8)), {}, 2, ["(S(0), S(0))->(P)", "(R, S(1))->(S(0))"]),
    "linear_bias": (F.linear, lambda: (rn(2, 4, 6), rn(8, 6), rn(8)), {}, 2,
                    ["(S(0), R, R)->(S(0))", "(S(1), R, R)->(S(1))", "(R, S(0), S(0))->(S(2))",
                     "(S(2), S(1), P)->(P)", "(P, R, P)->(P)", "(R, P, P)->(P)"]),
    "linear_no_bias": (F.linear, lambda: (rn(4, 6), rn(8, 6)), {}, 2,
                       ["(S(0), R)->(S(0))", "(R, S(0))->(S(1))", "(S(1), S(1))->(P)", "(P, R)->(P)"]),
    "einsum_bmm": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), lambda: (rn(2, 4, 6), rn(2, 6, 8)), {}, 2,
                   ["(S(0), S(0))->(S(0))", "(S(1), R)->(S(1))", "(S(2), S(1))->(P)", "(R, S(2))->(S(2))"]),
    "einsum_scores": (lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k), lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8)),
                      {}, 2, ["(S(0), S(0))->(S(0))", "(S(1), S(1))->(S(1))", "(S(2), R)->(S(2))",
                              "(R, S(2))->(S(3))", "(S(3), S(3))->(P)"]),
    "einsum_ellipsis_implicit": (lambda a, b: torch.einsum("...ij,jk", a, b), lambda: (rn(2, 4, 6), rn(6, 8)), {}, 2,
                                 ["(S(0), R)->(S(0))", "(S(2), S(0))->(P)", "(R, S(1))->(S(2))"]),
    "einsum_three": (lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c), lambda: (rn(4, 6), rn(6, 2), rn(2, 8)),
                     {}, 2, ["(S(1), S(0), R)->(P)", "(R, S(1), S(0))->(P)", "(R, R, P)->(P)"]),
    "embedding": (F.embedding, lambda: (labels(8, 2, 6), rn(8, 4)), {}, 2,
                  ["(R, S(0))->(S(0))", "(R, S(1))->(S(1))", "(S(1), R)->(S(2))", "(S(0), R)->(P)[embedding_vocab]"]),
    "embedding_padding_n3": (lambda i, w: F.embedding(i, w, padding_idx=4), lambda: (labels(9, 3, 6), rn(9, 6)), {},
                             3, ["(R, S(0))->(S(0))", "(S(0), R)->(P)[embedding_vocab]"]),
    "layer_norm": (F.layer_norm, lambda: (rn(4, 6, 8), (8,), rn(8), rn(8)), {}, 2,
                   ["(S(0), R, R)->(S(0))", "(S(1), R, R)->(S(1))"]),
    "native_layer_norm": (lambda x, w: aten.native_layer_norm(x, [6, 8], w, None, 1e-5),
                          lambda: (rn(4, 6, 8), rn(6, 8)), {}, 2, ["(S(0), R)->(S(0), S(0), S(0))"]),
    "rms_norm": (F.rms_norm, lambda: (rn(4, 6, 8), (8,), rn(8)), {}, 2, ["(S(0), R)->(S(0))", "(S(1), R)->(S(1))"]),
    "batch_norm_train": (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=True),
                         lambda: (rn(4, 6, 2, 2), rn(6), pos(6), rn(6), rn(6)), {}, 2,
                         ["(S(1), S(0), S(0), S(0), S(0))->(S(1))"]),
    "batch_norm_train_no_affine": (lambda x, m, v: F.batch_norm(x, m, v, training=True),
                                   lambda: (rn(4, 6, 5), rn(6), pos(6)), {}, 2, ["(S(1), S(0), S(0))->(S(1))"]),
    "batch_norm_eval": (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False),
                        lambda: (rn(4, 6, 2, 2), rn(6), pos(6), rn(6), rn(6)), {}, 2,
                        ["(S(1), S(0), S(0), S(0), S(0))->(S(1))", "(S(0), R, R, R, R)->(S(0))",
                         "(S(2), R, R, R, R)->(S(2))", "(S(3), R, R, R, R)->(S(3))"]),
    "native_batch_norm_functional": (
        lambda x, w, b, m, v: aten._native_batch_norm_legit_functional(x, w, b, m, v, True, 0.1, 1e-5),
        lambda: (rn(4, 6, 5), rn(6), rn(6), rn(6), pos(6)), {}, 2,
        ["(S(1), S(0), S(0), S(0), S(0))->(S(1), S(0), S(0), S(0), S(0))"]),
    "group_norm": (F.group_norm, lambda: (rn(4, 6, 5), 3, rn(6), rn(6)), {}, 2, ["(S(0), R, R)->(S(0))"]),
    "sdpa_causal": (sdpa(is_causal=True), lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8)), {}, 2,
                    ["(S(0), S(0), S(0))->(S(0))", "(S(1), S(1), S(1))->(S(1))"]),
    "sdpa_mask": (sdpa(), lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 1, 6, 6)), {}, 2,
                  ["(S(0), S(0), S(0), S(0))->(S(0))", "(S(1), S(1), S(1), R)->(S(1))"]),
    "sdpa_head_mask": (sdpa(), lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(4, 6, 6)), {}, 2,
                       ["(S(0), S(0), S(0), R)->(S(0))", "(S(1), S(1), S(1), S(0))->(S(1))"]),
    "sdpa_bool_mask": (sdpa(), lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8),
                                        (torch.rand(6, 6) > 0.3) | torch.eye(6, dtype=torch.bool)), {}, 2,
                       ["(S(0), S(0), S(0), R)->(S(0))", "(S(1), S(1), S(1), R)->(S(1))"]),
    "sdpa_gqa": (sdpa(enable_gqa=True), lambda: (rn(2, 4, 6, 8), rn(2, 2, 6, 8), rn(2, 2, 6, 8)), {}, 2,
                 ["(S(0), S(0), S(0))->(S(0))", "(S(1), S(1), S(1))->(S(1))"]),
    "sdpa_3d": (sdpa(), lambda: (rn(4, 6, 8), rn(4, 6, 8), rn(4, 6, 8)), {}, 2, ["(S(0), S(0), S(0))->(S(0))"]),
    "sdpa_flash_cpu": (lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True),
                       lambda: (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8)), {}, 2,
                       ["(S(0), S(0), S(0))->(S(0), S(0))", "(S(1), S(1), S(1))->(S(1), S(1))"]),
    "cross_entropy_mean": (F.cross_entropy, lambda: (rn(4, 5), labels(5, 4)), {}, 2,
                           ["(S(0), S(0))->(P)[loss_mean_partial]"]),
    "cross_entropy_sum": (F.cross_entropy, lambda: (rn(4, 5), labels(5, 4)), {"reduction": "sum"}, 2,
                          ["(S(0), S(0))->(P)"]),
    "cross_entropy_3d_none": (F.cross_entropy, lambda: (rn(4, 5, 6), labels(5, 4, 6)), {"reduction": "none"}, 2,
                              ["(S(0), S(0))->(S(0))", "(S(2), S(1))->(S(1))"]),
    "cross_entropy_3d_weighted": (
        lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=3, label_smoothing=0.1),
        lambda: (rn(4, 5, 6), labels(5, 4, 6), pos(5)), {}, 2,
        ["(S(0), S(0), R)->(P)[loss_mean_partial]", "(S(2), S(1), R)->(P)[loss_mean_partial]"]),
    "cross_entropy_soft": (F.cross_entropy, lambda: (rn(4, 5, 6), torch.softmax(rn(4, 5, 6), 1)), {}, 2,
                           ["(S(0), S(0))->(P)[loss_mean_partial]", "(S(2), S(2))->(P)[loss_mean_partial]"]),
    "nll_loss": (F.nll_loss, lambda: (torch.log_softmax(rn(6, 5), 1), labels(5, 6)), {}, 3,
                 ["(S(0), S(0))->(P)[loss_mean_partial]"]),
    "nll_loss_forward": (lambda x, t: aten.nll_loss_forward(x, t, None, 1, -100), lambda: (rn(4, 5), labels(5, 4)),
                         {}, 2, ["(S(0), S(0))->(P, P)[loss_mean_partial]"]),
    "mse_loss": (F.mse_loss, lambda: (rn(4, 6), rn(4, 6)), {}, 2,
                 ["(S(0), S(0))->(P)[loss_mean_partial]", "(S(1), S(1))->(P)[loss_mean_partial]"]),
    "mse_loss_none": (F.mse_loss, lambda: (rn(4, 6), rn(4, 6)), {"reduction": "none"}, 2,
                      ["(S(0), S(0))->(S(0))", "(S(1), S(1))->(S(1))"]),
    "l1_loss_sum": (F.l1_loss, lambda: (rn(4, 6), rn(4, 6)), {"reduction": "sum"}, 2, ["(S(0), S(0))->(P)"]),
    "bce_logits": (F.binary_cross_entropy_with_logits, lambda: (rn(4, 6), torch.rand(4, 6, dtype=D)),
                   {"weight": pos(4, 6), "pos_weight": pos(6)}, 2,
                   ["(S(0), S(0), S(0), R)->(P)[loss_mean_partial]",
                    "(S(1), S(1), S(1), S(0))->(P)[loss_mean_partial]"]),
    "conv1d": (F.conv1d, lambda: (rn(4, 6, 10), rn(4, 6, 3), rn(4)), {"padding": 1}, 2,
               ["(S(0), R, R)->(S(0))", "(R, S(0), S(0))->(S(1))", "(S(1), S(1), P)->(P)"]),
    "conv2d": (F.conv2d, lambda: (rn(4, 6, 7, 7), rn(4, 6, 3, 3), rn(4)), {"stride": 2, "dilation": 1}, 2,
               ["(S(0), R, R)->(S(0))", "(R, S(0), S(0))->(S(1))", "(S(1), S(1), P)->(P)"]),
    "conv2d_unbatched_no_bias": (F.conv2d, lambda: (rn(6, 7, 7), rn(4, 6, 3, 3)), {}, 2,
                                 ["(R, S(0))->(S(0))", "(S(0), S(1))->(P)"]),
    "conv_transpose2d": (F.conv_transpose2d, lambda: (rn(4, 6, 5, 5), rn(6, 4, 3, 3), rn(4)), {"stride": 2}, 2,
                         ["(S(0), R, R)->(S(0))", "(R, S(1), S(0))->(S(1))", "(S(1), S(0), P)->(P)"]),
    "conv_transpose1d": (F.conv_transpose1d, lambda: (rn(4, 6, 5), rn(6, 4, 3)), {"output_padding": 1, "stride": 2}, 2,
                         ["(S(0), R)->(S(0))", "(R, S(1))->(S(1))", "(S(1), S(0))->(P)"]),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rule_numerics(case):
    fn, make_args, kwargs, n, expect = CASES[case]
    torch.manual_seed(0)
    report = check_rule_numerics(fn, make_args(), kwargs, n=n)
    missing = [s for s in expect if s not in report.checked_str]
    assert not missing, f"{report.node.target}: expected {missing}, offered {sorted(report.all_str)}"
    unexpected = [(str(s), why) for s, why in report.skipped if s.lowering not in ("batch_norm_sync", "ring_attention")]  # those two run on real ranks
    assert not unexpected, unexpected


def strategies_of(fn, args, kwargs=None) -> set[str]:
    return check_rule_numerics(fn, args, kwargs or {}, n=2).all_str


def test_what_rules_do_not_offer():
    """Splits that would be wrong (or need an argument rewrite) are not offered."""
    assert strategies_of(lambda i, w: F.embedding(i, w, scale_grad_by_freq=True), (labels(8, 2, 6), rn(8, 4))) == {
        "(R, R)->(R)", "(S(1), R)->(S(2))"}
    assert not any("S(2)" in s.split("->")[0] for s in strategies_of(F.layer_norm, (rn(4, 6, 8), (8,))))
    train = strategies_of(lambda x, m, v: F.batch_norm(x, m, v, training=True), (rn(4, 6, 5), rn(6), pos(6)))
    assert {s for s in train if s.startswith("(S(0)")} == {"(S(0), R, R)->(S(0))[batch_norm_sync]"}
    grouped = strategies_of(F.conv2d, (rn(4, 6, 5, 5), rn(4, 3, 3, 3), rn(4)), {"groups": 2, "padding": "same"})
    assert grouped == {"(R, R, R)->(R)", "(S(0), R, R)->(S(0))"}
    sdpa_dims = strategies_of(sdpa(), (rn(2, 4, 6, 8), rn(2, 4, 6, 8), rn(2, 4, 6, 8)))
    # the sequences split only under ring attention; the head dim never
    assert not any(f"S({d})" in s for s in sdpa_dims if "[ring_attention]" not in s for d in (2, 3))
    assert {s for s in sdpa_dims if "ring_attention" in s} == {"(S(2), S(2), S(2))->(S(2))[ring_attention]"}
    ce = strategies_of(F.cross_entropy, (rn(4, 5, 6), labels(5, 4, 6)))
    assert not any(s.startswith("(S(1)") for s in ce)


def test_checker_catches_wrong_strategies(monkeypatch):
    """The checker is honest: a wrong forward or a wrong gradient fails."""
    bad_forward = Strategy1D((Shard(1), Shard(0)), (Shard(0),))  # a contracted dim is not S on the output
    monkeypatch.setitem(RULES, aten.mm.default, lambda call: [bad_forward])
    with pytest.raises(AssertionError, match="output 0"):
        check_rule_numerics(torch.mm, (rn(4, 6), rn(6, 8)))
    bad_partial = Strategy1D((Partial(), Partial()), (Partial(),))  # mm is not linear in both at once
    monkeypatch.setitem(RULES, aten.mm.default, lambda call: [bad_partial])
    with pytest.raises(AssertionError, match="differs"):
        check_rule_numerics(torch.mm, (rn(4, 6), rn(6, 8)))
    # Forward is right, but with scale_grad_by_freq the weight gradient uses global token counts.
    only_grad_wrong = Strategy1D((Replicate(), Shard(0)), (Shard(0),))
    monkeypatch.setitem(RULES, aten.embedding.default, lambda call: [only_grad_wrong])
    idx = torch.tensor([[1, 1, 1, 2], [1, 3, 3, 3]])
    with pytest.raises(AssertionError, match="gradient of operand 0"):
        check_rule_numerics(lambda i, w: F.embedding(i, w, scale_grad_by_freq=True), (idx, rn(8, 4)))


def _hand_built_node(target, args, kwargs=None):
    """An fx node whose operands carry meta (no kernel run: shapes come from the meta device)."""
    g = fx.Graph()
    vals, nodes = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = g.placeholder(f"t{len(nodes)}")
            p.meta[META] = tensor_meta_of(a)
            nodes.append(p)
            vals.append(a)
        else:
            nodes.append(a)
            vals.append(a)
    node = g.call_function(target, tuple(nodes), kwargs or {})
    node.meta[META] = tensor_meta_of(target(*vals, **(kwargs or {})))
    return node


@pytest.mark.parametrize("target,extra", [
    (aten._scaled_dot_product_flash_attention.default, ()),
    (aten._scaled_dot_product_efficient_attention.default, (None, True)),
    (aten._scaled_dot_product_efficient_attention.default, ("mask", True)),
    (aten._scaled_dot_product_cudnn_attention.default, (None, True)),
], ids=["flash", "efficient", "efficient_mask", "cudnn"])
def test_fused_attention_arity(target, extra):
    """GPU-only variants: built by hand on the meta device; every output gets a placement."""
    q = torch.empty(2, 4, 6, 8, device="meta")
    extra = tuple(torch.empty(2, 1, 6, 6, device="meta") if e == "mask" else e for e in extra)
    node = _hand_built_node(target, (q, q, q, *extra))
    found, has_rule = rule_strategies(node)  # raises on an arity mismatch
    assert has_rule and len(found) == 3
    for s, d in zip(found[1:], (0, 1)):
        assert s.outputs[0] == Shard(d) and s.outputs[1] == Shard(d) and s.inputs[:3] == (Shard(d),) * 3
        assert all(p == Replicate() for p in s.outputs[2:] if p != Shard(d))


def test_every_named_aten_op_has_a_rule():
    """Catch typos: each ``aten.x.overload`` (or ``aten.x``) named in the part-A files has a rule, or
    pricing facts registered beside the rules (a fused kernel that never reaches a plan's graph)."""
    seen = 0

    def known(op) -> bool:
        return lookup(op) is not None or find_registered(OP_FACTS, op) is not None

    for name in PART_A:
        for packet, overload in re.findall(r"\baten\.(\w+)(?:\.(\w+))?", (RULES_DIR / name).read_text()):
            seen += 1
            pkt = getattr(aten, packet)
            if overload:
                assert known(getattr(pkt, overload)), f"{name}: no rule for aten.{packet}.{overload}"
            else:
                assert any(known(getattr(pkt, o)) for o in pkt.overloads()), f"{name}: aten.{packet}"
    assert seen > 40


def test_every_family_module_is_imported():
    """A family module the package does not import would register nothing, silently."""
    shared = {"__init__", "registry", "common", "kernel_facts"}  # kernel_facts registers facts, no rules
    assert find_registered(OP_FACTS, torch.ops.aten.native_layer_norm.default) is not None  # kernel_facts ran
    on_disk = {p.stem for p in RULES_DIR.glob("*.py")} - shared
    assert on_disk == {m.__name__.rsplit(".", 1)[-1] for m in FAMILIES}
    assert lookup(operator.getitem) is not None


def test_parse_einsum():
    assert parse_einsum("ij,jk->ik", [2, 2]) == (["ij", "jk"], "ik")
    assert parse_einsum("ba,ac", [2, 2]) == (["ba", "ac"], "bc")
    assert parse_einsum("...ij,...jk->...ik", [4, 3]) == (["αβij", "βjk"], "αβik")  # right-aligned batch
    with pytest.raises(ValueError, match="operands"):
        parse_einsum("ij,jk->ik", [2])


def test_einsum_skips_diagonals_and_size_one():
    found = {str(s) for s in einsum_strategies(["ii", "i"], "i", [(4, 4), (4,)])}
    assert found == {"(P, R)->(P)", "(R, P)->(P)"}
    found = {str(s) for s in einsum_strategies(["mk", "kn"], "mn", [(1, 6), (6, 8)], partial_operands=False)}
    assert found == {"(S(1), S(0))->(P)", "(R, S(1))->(S(1))"}
