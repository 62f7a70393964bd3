"""In-place writes keep their values and gradients under every plan.

Writes through views of intermediate values (``key[..., :d] = k_pass``) are captured as functional
scatters: the graph, single-device values and gradients. In-place ops on a value itself
(``w /= w.sum()``, as Mixtral normalizes its routing weights) stay in place and, when the plan runs
them on a redistributed copy, are written back differentiably. Both models train under random plans
on 2 gloo ranks equal to one device."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.runtime.localize import written_operands
from autoshard.testing.equivalence import Tolerance, compiled_gradient_mismatches, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks
from autoshard.testing.rule_numerics import check_rule_numerics

aten = torch.ops.aten


class SplitKey(nn.Module):
    """DeepSeek's key assembly: a fresh tensor filled through two slices, one from a broadcast value,
    then a write into a transposed view, then read by a matmul."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 2)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        a, b = self.a(x), self.b(x)[:, :, :1]               # (B, S, d), (B, S, 1)
        key = a.new_empty(a.shape[0], a.shape[1], 2 * a.shape[2])
        key[..., : a.shape[2]] = a
        key[..., a.shape[2]:] = b                            # broadcast over the last dim
        key.transpose(1, 2)[:, 0] *= 2.0                     # a write through transpose + select
        return self.out(F.gelu(key))


class InPlaceNormalize(nn.Module):
    """Mixtral's routing weights: the top-2 of a softmax, normalized in place (``w /= w.sum(-1, keepdim=True)``)
    on a value that needs a gradient."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.gate = nn.Linear(d, 4)
        self.out = nn.Linear(2, d)

    def forward(self, x):
        w = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1).values
        w /= w.sum(-1, keepdim=True)
        return self.out(w)


MODELS = {"split_key": SplitKey, "in_place_normalize": InPlaceNormalize}
# Plans that write in place into a redistributed value: the top-k values replicated, then chunked for
# the in-place division (a chunk is a collective's result, which autograd forbids writing into).
PINS = {"split_key": {"ops": {"new_empty": ("R",), "slice_scatter*": ("S(0)",)}},
        "in_place_normalize": {"ops": {"topk": ("R",), "getitem": ("S(0)",), "div_": ("S(0)",)}}}


def _batch(name: str = "split_key"):
    torch.manual_seed(0)
    return MODELS[name](), torch.randn(4, 6, 8), torch.randn(4, 6, 8)


def test_writes_through_views_become_scatters_with_equal_values_and_gradients():
    model, x, y = _batch()
    cg = capture(model, (x,), loss_fn=F.mse_loss, target=y)
    writes = [n for n in cg.gm.graph.nodes if n.op == "call_function" and written_operands(n)]
    assert not writes, [n.format_node() for n in writes]
    targets = {n.target for n in cg.gm.graph.nodes}
    assert {aten.slice_scatter.default, aten.select_scatter.default} <= targets

    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    loss = cg.gm(*params, x, y)
    loss.backward()
    ref = F.mse_loss(model(x), y)
    ref.backward()
    assert torch.allclose(loss, ref)
    for p, q in zip(params, model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), "gradient differs from eager"


def test_view_scatter_rules_match_unsharded():
    x, src = torch.randn(4, 8, 16), torch.randn(4, 8, 8)
    for n in (2, 4):
        report = check_rule_numerics(lambda x, s: torch.slice_scatter(x, s, 2, 4, 12), (x, src), n=n)
        assert report.checked_str == {"(R, R)->(R)", "(S(0), S(0))->(S(0))", "(S(1), S(1))->(S(1))", "(P, P)->(P)"}
        report = check_rule_numerics(lambda x, s: torch.select_scatter(x, s, 1, 3), (x, torch.randn(4, 16)), n=n)
        assert report.checked_str == {"(R, R)->(R)", "(S(0), S(0))->(S(0))", "(S(2), S(1))->(S(2))", "(P, P)->(P)"}


def _random_plans_worker(rank, world, seeds):
    from autoshard.api import plan_captured
    from autoshard.compiled import CompiledModel
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import broadcast_json, setup_distributed

    mesh = Mesh.of((world,))
    env = setup_distributed(mesh)
    tol = Tolerance()
    failures = []
    for name in MODELS:
        model, x, y = _batch(name)
        cg = capture(model, (x,), loss_fn=F.mse_loss, target=y)
        for seed, pins in [(None, PINS[name])] + [(seed, {}) for seed in seeds]:
            payload = (plan_captured(cg, mesh, hardware="cpu", random_seed=seed, pins=pins).to_json()
                       if rank == 0 else None)
            plan = Plan.from_json(broadcast_json(payload, src=0, env=env)).attach(cg, mesh)
            label = f"{name} " + (f"random plan {seed}" if seed is not None else f"pinned {pins}")
            failures += train_against_one_device(
                label, CompiledModel(model, plan, env), copy.deepcopy(model), ((x,), y), loss_fn=F.mse_loss,
                steps=2, check_gradients=lambda p, r, label=label: compiled_gradient_mismatches(label, p, r, tol))
    return failures


def test_random_plans_keep_in_place_writes_on_2_ranks():
    failures = failures_of(run_ranks(_random_plans_worker, 2, list(range(8)), timeout=300))
    assert not failures, "\n".join(failures)
