"""Parameters and buffers a forward writes train as on one device under any plan.

Written through an alias:

``nn.Embedding(max_norm=1.0)`` renormalises the rows it looks up through ``weight.detach()``; an
exponential moving average kept as ``self.avg.detach().mul_(0.9).add_(...)`` writes a buffer the same
way. Before ``passes.sharding.aliased_state_writes``, a plan that sharded the weight (or the buffer), or
read the alias split, gave the write a private copy: the step-0 loss and every later state differed from
one device (random plans 2 and 3 of the embedding, 1 of the average; the solver's replicated plan hid it).
Now every plan holds such a tensor whole. On 4 gloo ranks, mesh (2, 2), float64: each model under
random plans and the solver's plan, 3 SGD steps, loss at every step and the full state dict against one
device. One process checks the planner's side: the tensors found, the narrowing, and a pin that
would split the weight refused with an error naming the op.

Written inside a no-grad region: spectral norm's power iteration (``parametrizations.spectral_norm``)
updates its ``_u``/``_v`` buffers with ``out=`` under ``torch.no_grad``. The region used to be inlined
with grad on, so every plan raised "functions with out=... arguments don't support automatic
differentiation"; now its operands computed from parameters are detached (``passes/capture/tracers.py``),
and a discriminator with three spectral-normed layers trains exactly under random plans too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.equivalence import Tolerance, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-9, atol=1e-10, grad_atol=1e-10)  # float64: anything past rounding is a real difference


class RenormedEmbedding(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, max_norm=1.0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


class MovingAverage(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("avg", torch.zeros(width))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.avg.detach().mul_(0.9).add_(h.mean((0, 1)) * 0.1)
        return h - self.avg


class SpectralDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm
        self.c1 = spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.c2 = spectral_norm(nn.Conv2d(8, 8, 3, stride=2, padding=1))
        self.fc = spectral_norm(nn.Linear(8 * 4 * 4, 1))

    def forward(self, x):
        h = F.leaky_relu(self.c2(F.leaky_relu(self.c1(x), 0.2)), 0.2)
        return self.fc(h.flatten(1))


def _token_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def build(name: str):
    """(model, inputs, target, loss_fn) in float64, seeded."""
    torch.manual_seed(0)
    if name == "embedding":
        model = RenormedEmbedding().double()
        return model, (torch.randint(0, 64, (8, 4)),), torch.randint(0, 64, (8, 4)), _token_loss
    if name == "spectral":
        model = SpectralDiscriminator().double()
        return model, (torch.randn(8, 3, 8, 8, dtype=torch.float64),), torch.randn(8, 1, dtype=torch.float64), F.mse_loss
    model = MovingAverage().double()
    return model, (torch.randn(8, 4, 16, dtype=torch.float64),), torch.randn(8, 4, 16, dtype=torch.float64), F.mse_loss


#: (model, random plan seed or None for the solver's plan): the seeds are ones whose plans split the tensor.
CASES = [("embedding", 2), ("embedding", 3), ("embedding", None), ("average", 1), ("average", 2), ("spectral", 2),
         ("spectral", 3)]


def worker(rank: int, world: int, cases) -> list[str]:
    import autoshard
    from autoshard.api import plan_captured
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh

    torch.set_num_threads(1)
    failures = []
    for name, seed in cases:
        label = f"{name} {'solver' if seed is None else f'random(seed={seed})'}"
        model, inputs, target, loss_fn = build(name)
        reference = copy.deepcopy(model)
        plan = None
        if seed is not None:
            captured = capture(copy.deepcopy(model), inputs, loss_fn=loss_fn, target=target)
            plan = plan_captured(captured, Mesh.of((2, 2)), hardware="cpu", random_seed=seed)
        cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", plan=plan)
        failures += train_against_one_device(label, cm, reference, (inputs, target), loss_fn=loss_fn, steps=3,
                                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), tol=TOL)
    return failures


def test_state_written_in_forward_trains_as_one_device_under_any_plan():
    failures = failures_of(run_ranks(worker, 4, CASES))
    assert not failures, "\n".join(failures)


def _captured(name: str):
    from autoshard.passes.capture.export import capture
    model, inputs, target, loss_fn = build(name)
    return capture(model, inputs, loss_fn=loss_fn, target=target)


def test_the_planner_holds_tensors_written_through_an_alias_whole():
    from autoshard.passes.sharding.aliased_state_writes import aliased_state_writes
    from autoshard.passes.solve.problem import strategy_choices
    from autoshard.passes.spec import Replicate

    captured = _captured("embedding")
    found = aliased_state_writes(captured)
    assert found.state == {"p_emb_weight"}
    assert [str(captured.node(n).target) for n in found.writers] == ["aten.embedding_renorm_.default"]
    mesh, table, allowed = strategy_choices(captured, (2, 2), None, storage_forms=True)
    kept = [table["p_emb_weight"][k] for k in allowed["p_emb_weight"]]
    assert kept and all(isinstance(p, Replicate) for s in kept for p in s.outputs[0])
    assert len(kept) < len(table["p_emb_weight"])  # the split storages (FSDP, S(1), ...) are gone
    assert any(s.lowerings and any(s.lowerings) for s in kept)  # ZeRO-1/2 keep the weight whole: allowed
    for name in found.aliases:
        assert all(isinstance(p, Replicate) for k in allowed[name] for pls in table[name][k].outputs for p in pls)
    assert not aliased_state_writes(_plain())  # a plain embedding is not narrowed

    average = aliased_state_writes(_captured("average"))
    assert average.state == {"b_avg"} and len(average.writers) == 2  # mul_ and the add_ through it


def _plain():
    from autoshard.passes.capture.export import capture
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    ids = torch.randint(0, 64, (8, 4))
    return capture(model, (ids,), loss_fn=_token_loss, target=ids)


def test_a_pin_that_splits_a_tensor_written_through_an_alias_is_refused_naming_the_op():
    import autoshard
    from autoshard.passes.sharding.pins import PinError

    model, inputs, target, loss_fn = build("embedding")
    with pytest.raises(PinError, match=r"p_emb_weight.*embedding_renorm_.*whole"):
        autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                       hardware="cpu", params={"emb.weight": ("S(0)", "R")})

