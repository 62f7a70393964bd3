"""Rule numerics for part B (elementwise, reductions, views, indexing, factory).

Each case exports a small function and checks, with the rule-numerics harness of
autoshard/testing/rule_numerics.py, EVERY strategy the registry gives EVERY node whose rule lives in a part-B
module, on n = 2 and n = 4 simulated ranks in one process (operands split by placement, the op run
per rank with its size argument rewritten to local sizes as the runtime does, outputs and
gradients reassembled and compared with the unsharded op).

Every strategy must be checked at n = 2 (shapes are chosen so it divides); n = 4 where it divides.
Part-B rules may only ask for the ``mean_partial`` lowering. The same check then runs over every
part-B node of captured test models (autoshard/testing/models.py), and a self-test feeds the harness wrong
strategies to prove it fails.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.sharding.rules import RULES, OpCall, lookup, rule_strategies
from autoshard.passes.sharding.rules.indexing import index_layout
from autoshard.passes.sharding.rules.views import view_groups
from autoshard.passes.spec import Strategy1D, TensorMeta, parse_placement
from autoshard.testing.models import BUILDERS
from autoshard.testing.rule_numerics import RuleCheck, check_node, record_calls, trace_calls

aten = torch.ops.aten
PART_B = {"elementwise", "reductions", "views", "indexing", "factory"}


# ---------------------------------------------------------------------------------------------- harness

def _is_part_b(node: fx.Node) -> bool:
    fn = lookup(node.target)
    return fn is not None and fn.__module__.rsplit(".", 1)[-1] in PART_B


def check_part_b_node(node, args, kwargs, n, gen) -> RuleCheck:
    """``rule_numerics.check_node``, plus: a part-B rule asks for no lowering but ``mean_partial``.

    In-place ops are checked by their outputs, not by what they leave in the written operand:
    ``mul_`` offers ``(R, P)->(P)``, whose ``self`` ends up holding a summand, not its ``R``.
    """
    odd = [str(s) for s in rule_strategies(node)[0] if s.lowering not in (None, "mean_partial")]
    assert not odd, f"{node.format_node()}: part-B rules may only ask for mean_partial, got {odd}"
    return check_node(node, args, kwargs, n, gen=gen, writes=False)


def check(fn, *inputs, ns=(2, 4), only=None) -> dict[str, dict]:
    """Check every part-B node of ``fn``'s graph (or every call of ``only``); returns
    {node name: {"target", "strategies"}}."""
    _, seen = trace_calls(fn, inputs, select=_is_part_b if only is None else (lambda n: n.target == only))
    gen = torch.Generator().manual_seed(0)
    report = {}
    for node, (args, kwargs) in seen.items():
        per_n = {n: check_part_b_node(node, args, kwargs, n, gen) for n in ns}
        missed = [str(s) for s, _ in per_n[ns[0]].skipped]
        assert not missed, f"{node.format_node()}: strategies {missed} not checked on {ns[0]} ranks (indivisible)"
        report[node.name] = {"target": node.target, "strategies": per_n[ns[0]].all_str}
    return report


def strategies_of(report, target) -> set[str]:
    found = [r["strategies"] for r in report.values() if r["target"] == target]
    assert found, f"{target} not in the traced graph: {[r['target'] for r in report.values()]}"
    return found[0]


def f64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def idx(high, *shape):
    return torch.randint(0, high, shape)


def uniq_idx(high, *shape, dim):
    """Indices with no repeats along ``dim`` (so scatter has no write races)."""
    return torch.rand(*shape[:dim], high, *shape[dim + 1:]).argsort(dim).narrow(dim, 0, shape[dim])


# ---------------------------------------------------------------------------------------------- cases

def _unary(x):
    a = x.abs() + 0.5
    return (x.neg(), x.exp(), a.log(), a.sqrt(), a.rsqrt(), x.pow(2), x.sin(), x.cos(), x.tanh(), x.sigmoid(),
            F.relu(x), F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x), F.softplus(x), torch.erf(x),
            a.reciprocal(), x.clone(), x.detach(), x.clamp(-0.5, 0.5), x.clamp(min=0), F.hardtanh(x),
            F.leaky_relu(x), F.elu(x), F.mish(x), F.hardswish(x), x.square(), x.sign(),
            F.dropout(x, 0.0, True), aten.native_dropout(x, 0.0, True)[0], x.transpose(0, 1).contiguous())


def _casts(x, y32, i):
    return (x.to(torch.float32), x.type_as(y32), aten._to_copy(x, dtype=torch.float32), x.to(torch.int64),
            i.to(torch.float64), i * 3, x.float().double())


def _compare(x, y, i, j, v0):
    m = x > 0
    return (x.eq(y), x.ne(y), x < y, x <= 0.1, x >= y, torch.logical_not(m), m & (y > 0), m | (y > 0),
            i & j, i | j, i ^ j, ~i, aten.__and__(m, y > 0), aten.__or__(i, j), *torch.broadcast_tensors(x, y[0], m), x.masked_fill(m, 0.0), x.masked_fill(m, -1.0), x.masked_fill(m, v0))


def _binary(x, y, z, s):
    xp = x.abs() + 0.5
    return (x + y, x - z, x * y, x / z, torch.maximum(x, z), torch.minimum(y, x), torch.pow(xp, z),
            torch.atan2(x, y), torch.fmod(x, z), torch.remainder(x, y), x * 2, x / 3, x + 1, 2 - x, x * s,
            torch.add(x, y, alpha=2), torch.max(x, z), x.div(z, rounding_mode="floor"), torch.sub(z, x))


def _inplace(x, y, z, s):
    return (x.clone().add_(y), x.clone().mul_(z), x.clone().sub_(1), x.clone().div_(s),
            F.relu(x.clone(), inplace=True), x.clone().copy_(z), x.clone().mul_(2))


def _ternary(x, y, z, w):
    return (torch.where(x > 0, x, y), torch.where(x > 0, x, 0.0), torch.addcmul(x, y, z, value=0.5),
            torch.addcdiv(x, y, z.abs() + 1), torch.lerp(x, z, 0.3), torch.lerp(x, y, w))


CASES = {
    "unary": (_unary, lambda: (f64(4, 6, 8),)),
    "casts": (_casts, lambda: (f64(4, 6), torch.randn(4, 6), idx(9, 4, 6))),
    "compare": (_compare, lambda: (f64(4, 6, 8), f64(6, 8), idx(9, 4, 6, 8), idx(9, 8),
                                   torch.tensor(2.0, dtype=torch.float64))),
    "binary_broadcast": (_binary, lambda: (f64(4, 6, 8), f64(6, 1), f64(8), torch.tensor(1.5, dtype=torch.float64))),
    "inplace": (_inplace, lambda: (f64(4, 6, 8), f64(6, 1), f64(8), torch.tensor(1.5, dtype=torch.float64))),
    "ternary": (_ternary, lambda: (f64(4, 6, 8), f64(6, 1), f64(8), torch.rand(4, 1, 8, dtype=torch.float64))),
    "sum": (lambda x: (x.sum(1), x.sum(1, keepdim=True), x.sum(), x.sum((0, 2)), x.sum(-1, keepdim=True),
                       (x > 0).sum(1)), lambda: (f64(4, 6, 8),)),
    "mean": (lambda x: (x.mean(1), x.mean((0, 2), keepdim=True), x.mean(), x.mean(-1)), lambda: (f64(4, 6, 8),)),
    "max": (lambda x: (x.amax(-1, keepdim=True), x.amin(1), *x.max(1), *x.min(1, keepdim=True), x.max(),
                       x.argmax(-1), x.argmin(0, keepdim=True), x.argmax()), lambda: (f64(4, 6, 8),)),
    "stats": (lambda x: (x.var(1), x.std(1, keepdim=True), *torch.var_mean(x, 1), x.var(), x.prod(1),
                         torch.logsumexp(x, -1), x.norm(dim=1), torch.linalg.vector_norm(x, dim=(0, 2), keepdim=True),
                         (x > 0).all(), (x > 0).any(-1), (x > 0).all(1)), lambda: (f64(4, 6, 8),)),
    "scans": (lambda x: (x.softmax(-1), F.softmax(x, 1), x.log_softmax(-1), aten._softmax(x, 2, False),
                         aten._log_softmax(x, 0, False), x.cumsum(1), x.cumprod(2), torch.diff(x, dim=1),
                         torch.diff(x, dim=-1, prepend=x[:, :, :1], append=x[:, :, :2])), lambda: (f64(4, 6, 8),)),
    "view_merge": (lambda x: (x.view(24, 8), x.reshape(24, 8), x.view(-1, 8), x.view(4, 48), x.flatten(1),
                              x.flatten()), lambda: (f64(4, 6, 8),)),
    "view_split": (lambda y: (y.view(4, 6, 8), y.reshape(2, 12, 8), aten._unsafe_view(y, [4, 6, 8])),
                   lambda: (f64(24, 8),)),
    "view_heads": (lambda z: (z.view(4, 16, 4, 8), z.unflatten(2, (4, 8)), z.unflatten(2, (-1, 8))),
                   lambda: (f64(4, 16, 32),)),
    "view_mixed": (lambda x, u: (x.view(2, 12, 8), u.view(4, 6), u.view(4, 6, 1), u.view(24)),
                   lambda: (f64(4, 6, 8), f64(4, 1, 6))),
    "permute": (lambda x, m: (x.transpose(0, 1), m.t(), x.permute(2, 0, 1), x.movedim(0, 2), x.mT,
                              x.swapaxes(0, 2), x.swapdims(1, 2), aten.numpy_T(x), m.T),
                lambda: (f64(4, 6, 8), f64(4, 6))),
    "squeeze": (lambda x, u: (u.squeeze(1), u.squeeze(), u.squeeze((1,)), x.unsqueeze(0), x.unsqueeze(-1),
                              x.squeeze(0)), lambda: (f64(4, 6, 8), f64(4, 1, 8))),
    "expand": (lambda u, z, x: (u.expand(4, 6, 8), z.expand(4, 6, 8), u.expand(-1, 6, -1), u.expand_as(x)),
               lambda: (f64(4, 1, 8), f64(8), f64(4, 6, 8))),
    "split": (lambda x: (*x.split(2, 1), *x.split([2, 4], 1), *x.chunk(2, 2), *x.unbind(1),
                         *torch.tensor_split(x, 3, dim=1)), lambda: (f64(4, 6, 8),)),
    "cat": (lambda x, y: (torch.cat([x, y], 1), torch.cat([x, x], 0), torch.stack([x, x], 0),
                          torch.stack([x, x], -1)), lambda: (f64(4, 6, 8), f64(4, 2, 8))),
    "slice": (lambda x: (x[:, 1:3], x[:, :, ::2], aten.slice.Tensor(x, 1, 0, 2 ** 63 - 1), x[:, 1],
                         x.narrow(2, 2, 4), x.select(0, -1)), lambda: (f64(4, 6, 8),)),
    "index_select": (lambda x, i, j: (x.index_select(1, i), x.index_select(0, j)),
                     lambda: (f64(4, 6, 8), idx(6, 4), idx(4, 2))),
    "repeat_flip": (lambda x: (x.repeat(2, 1, 1), x.repeat(2, 1, 1, 2), x.flip(0), x.roll(1, 2), x.roll(1)),
                    lambda: (f64(4, 6, 8),)),
    "pad": (lambda x: (F.pad(x, (1, 2)), F.pad(x, (1, 2, 0, 2), value=1.0), F.pad(x, (1, 1), mode="reflect"),
                       aten.constant_pad_nd(x, [0, 0, 2, 0]), *x.split([2, 4], 1)), lambda: (f64(4, 6, 8),)),
    "view_as": (lambda x, y: (x.view_as(y), x.reshape_as(y)), lambda: (f64(4, 6, 8), f64(24, 8))),
    "sort": (lambda x: (*torch.topk(x, 2, -1), *torch.topk(x, 3, 1, largest=False), *torch.sort(x, 1),
                        *torch.sort(x, descending=True, stable=True), x.argsort(-1)), lambda: (f64(4, 6, 8),)),
    "gather": (lambda x, a, b, c: (torch.gather(x, 2, a), torch.gather(x, 1, b), torch.gather(x, 2, c)),
               lambda: (f64(4, 6, 8), idx(8, 4, 6, 2), idx(6, 4, 4, 8), idx(8, 2, 6, 2))),
    "scatter": (lambda x, i, src: (torch.zeros_like(x).scatter_add(2, i, src), x.scatter(2, i, src),
                                   x.scatter(2, i, 1.0), x.scatter_reduce(2, i, src, "amax"),
                                   x.clone().scatter_add_(2, i, src)),
                lambda: (f64(4, 6, 8), uniq_idx(8, 4, 6, 4, dim=2), f64(4, 6, 4))),
    "index": (lambda x, i, i0, i2, b0, b1: (x[i], x[:, i], x[i0, :, i2], x[b0, b1]),
              lambda: (f64(4, 6, 8), idx(4, 6), idx(4, 2), idx(8, 2), idx(4, 2, 1), idx(6, 1, 4))),
    "index_put": (lambda x, i, v, w: (x.index_put((i,), v, accumulate=True), aten.index_put(x, [None, i], w),
                                      x.clone().index_put_((i,), v)),
                  lambda: (f64(4, 6, 8), torch.tensor([0, 2]), f64(2, 6, 8), f64(4, 2, 8))),
    "factories": (lambda x: (x + torch.arange(8), x + torch.zeros(6, 8), x + torch.ones(6, 8),
                             x + torch.full((6, 8), 2.0), x * torch.scalar_tensor(2.0), torch.empty(4, 6)),
                  lambda: (f64(4, 6, 8),)),
    "likes": (lambda x: (torch.zeros_like(x), torch.ones_like(x), torch.empty_like(x), torch.full_like(x, 2.0),
                         torch.rand_like(x), torch.randn_like(x)), lambda: (f64(4, 6, 8),)),
    "new": (lambda x: (x.new_zeros(4, 6), x.new_ones(8, 6), x.new_empty(4, 6, 8), x.new_full((4, 6, 8), 2.0)),
            lambda: (f64(4, 6, 8),)),
    "tril": (lambda x, q: (x.tril(), x.triu(1), torch.ones(4, 4).triu(1).bool(), q + torch.tensor([1.0, 2.0])),
             lambda: (f64(4, 6, 8), f64(2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_numerics(case):
    torch.manual_seed(0)
    fn, make = CASES[case]
    report = check(fn, *make())
    assert report, f"{case}: no part-B op in the traced graph"


@pytest.mark.parametrize("builder", ["gpt", "cnn"])
def test_every_part_b_node_of_a_captured_model(builder):
    """Every part-B node of a real captured program (float64, so sums of summands stay exact)."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = BUILDERS[builder]()
    model = model.double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    target = target.double() if target.is_floating_point() else target
    cg = capture(model, inputs, loss_fn=loss_fn, target=target)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    feed = [state[f].detach().clone() for f in [*cg.params.values(), *cg.buffers.values()]] + [*inputs, target]
    seen = record_calls(cg.gm, feed, _is_part_b)
    assert len(seen) >= 5, f"{builder}: only {len(seen)} part-B nodes captured"
    gen = torch.Generator().manual_seed(0)
    for node, (args, kwargs) in seen.items():
        report = check_part_b_node(node, args, kwargs, 2, gen)
        assert not report.skipped, f"{node.format_node()}: {report.skipped}"


# ---------------------------------------------------------------------------------------------- known answers

def _one(fn, *inputs, target):
    return strategies_of(check(fn, *inputs, ns=(2,)), target)


def test_view_groups():
    assert view_groups((4, 6, 8), (24, 8)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((24, 8), (4, 6, 8)) == [([0], [0, 1]), ([1], [2])]
    assert view_groups((4, 16, 32), (4, 16, 4, 8)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert view_groups((4, 1, 6), (2, 12)) == [([0, 2], [0, 1])]
    assert view_groups((4, 6), (5, 5)) == []


def test_view_known_answers():
    x = f64(4, 6, 8)
    assert _one(lambda x: x.view(24, 8), x, target=aten.view.default) == {
        "(R)->(R)", "(S(0))->(S(0))", "(S(2))->(S(1))", "(P)->(P)"}
    assert _one(lambda y: y.view(4, 6, 8), f64(24, 8), target=aten.view.default) == {
        "(R)->(R)", "(S(0))->(S(0))", "(S(1))->(S(2))", "(P)->(P)"}
    assert _one(lambda z: z.view(4, 16, 4, 8), f64(4, 16, 32), target=aten.view.default) == {
        "(R)->(R)", "(S(0))->(S(0))", "(S(1))->(S(1))", "(S(2))->(S(2))", "(P)->(P)"}
    # unflatten sizes are not rewritten: the unflattened dim splits only behind a leading -1
    assert "(S(2))->(S(2))" not in _one(lambda z: z.unflatten(2, (4, 8)), f64(4, 16, 32), target=aten.unflatten.int)
    assert "(S(2))->(S(2))" in _one(lambda z: z.unflatten(2, (-1, 8)), f64(4, 16, 32), target=aten.unflatten.int)
    assert _one(lambda u: u.squeeze(), f64(4, 1, 8), target=aten.squeeze.default) == {"(R)->(R)", "(P)->(P)"}
    assert _one(lambda x: x.transpose(1, 2), x, target=aten.transpose.int) >= {"(P)->(P)", "(S(1))->(S(2))"}
    assert "(S(1))->(S(1), S(1), S(1))" not in _one(lambda x: x.split(2, 1), x, target=aten.split.Tensor)
    assert _one(lambda x: torch.stack([x, x], 1), x, target=aten.stack.default) >= {"(S(1), S(1))->(S(2))"}
    assert "(S(1), S(1))->(S(1))" not in _one(lambda x: torch.cat([x, x], 1), x, target=aten.cat.default)


def test_reduction_known_answers():
    x = f64(4, 6, 8)
    assert _one(lambda x: x.sum(1), x, target=aten.sum.dim_IntList) == {
        "(R)->(R)", "(S(0))->(S(0))", "(S(1))->(P)", "(S(2))->(S(1))", "(P)->(P)"}
    assert _one(lambda x: x.sum(1, keepdim=True), x, target=aten.sum.dim_IntList) >= {"(S(2))->(S(2))"}
    assert _one(lambda x: x.mean(1), x, target=aten.mean.dim) >= {"(S(1))->(P)[mean_partial]", "(P)->(P)"}
    assert _one(lambda x: x.amax(1), x, target=aten.amax.default) == {"(R)->(R)", "(S(0))->(S(0))", "(S(2))->(S(1))"}
    assert _one(lambda x: x.softmax(-1), x, target=aten.softmax.int) == {
        "(R)->(R)", "(S(0))->(S(0))", "(S(1))->(S(1))"}
    assert "(P)->(P)" not in _one(lambda x: (x > 0).sum(1), x, target=aten.sum.dim_IntList)  # no integer summands


def test_elementwise_known_answers():
    x, b = f64(4, 8), f64(8)
    assert _one(lambda x, b: x + b, x, b, target=aten.add.Tensor) == {
        "(R, R)->(R)", "(S(0), R)->(S(0))", "(S(1), S(0))->(S(1))", "(P, P)->(P)"}
    assert "(P)->(P)" not in _one(lambda x: x + 1, x, target=aten.add.Tensor)
    assert _one(lambda x, b: x * b, x, b, target=aten.mul.Tensor) >= {"(P, R)->(P)", "(R, P)->(P)"}
    assert _one(lambda x, b: x / b, x, b, target=aten.div.Tensor) >= {"(P, R)->(P)"}
    assert "(R, P)->(P)" not in _one(lambda x, b: x / b, x, b, target=aten.div.Tensor)
    assert not any("P" in s for s in _one(lambda x: x.exp(), x, target=aten.exp.default))
    assert "(P)->(P)" not in _one(lambda x: x.to(torch.int64), x, target=aten.to.dtype)


def test_masked_select_is_replicated_only():
    m = TensorMeta((4, 6), torch.float32)
    mask = TensorMeta((4, 6), torch.bool)
    call = OpCall(aten.masked_select.default, (m, mask), {}, (m, mask), (TensorMeta((7,), torch.float32),))
    assert RULES[aten.masked_select.default](call) == []


def test_index_layout():
    m = TensorMeta((5,), torch.int64)
    assert index_layout(3, [None, m]) == ({0: 0, 2: 2}, [1], (5,))
    assert index_layout(3, [m, None, m]) == ({1: 1}, [0], (5,))


# A harness that cannot fail proves nothing: each bogus strategy below must be caught.
BOGUS = [
    (lambda x: x.view(24, 8), (f64(4, 6, 8),), aten.view.default, "(S(1))->(S(0))"),
    (lambda x: x.mean(1), (f64(4, 6, 8),), aten.mean.dim, "(S(1))->(P)"),
    (lambda x: x.amax(-1), (f64(4, 6, 8),), aten.amax.default, "(S(2))->(P)"),
    (lambda x: x.softmax(-1), (f64(4, 6, 8),), aten.softmax.int, "(S(2))->(S(2))"),
    (lambda x: x.exp(), (f64(4, 6, 8),), aten.exp.default, "(P)->(P)"),
    (lambda x, y: x + y, (f64(4, 8), f64(4, 8)), aten.add.Tensor, "(P, R)->(P)"),
    (lambda x: x.transpose(0, 1), (f64(4, 6, 8),), aten.transpose.int, "(S(0))->(S(0))"),
    (lambda z: z.expand(4, 6, 8), (f64(8),), aten.expand.default, "(S(0))->(S(0))"),
    (lambda x: x.sum(1), (f64(4, 6, 8),), aten.sum.dim_IntList, "(P)->(R)"),
]


@pytest.mark.parametrize("fn, inputs, target, bogus", BOGUS, ids=[b[3] + str(b[2]) for b in BOGUS])
def test_harness_catches_wrong_strategies(monkeypatch, fn, inputs, target, bogus):
    def parse(group):
        return tuple(parse_placement(p) for p in group[1:-1].split(", ") if p)

    ins, outs = bogus.split("->")
    wrong = Strategy1D(parse(ins), parse(outs))
    monkeypatch.setitem(RULES, target, lambda call: [wrong])
    with pytest.raises(AssertionError, match="under"):
        check(fn, *inputs, ns=(2,), only=target)


def test_numpy_T_reverses_every_dim():
    """``x.T`` (Falcon's attention) keeps each split dim split, at its reversed position."""
    report = check(lambda x: (aten.numpy_T(x),), f64(4, 6, 8), only=aten.numpy_T.default)
    assert {"(S(0))->(S(2))", "(S(1))->(S(1))", "(S(2))->(S(0))"} <= strategies_of(report, aten.numpy_T.default)
