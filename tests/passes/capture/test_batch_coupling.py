"""``passes.batch_coupling``: which ops make a step's maths depend on how the batch is cut.

BatchNorm in training mode and reductions over the batch dimension are reported (with node name and
module path); eval-mode BatchNorm, per-row work, reductions over other dimensions and a mean loss
are not (a false report would needlessly turn accumulation off for every transformer)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.batch_coupling import batch_coupled_ops
from autoshard.passes.capture.export import capture
from autoshard.testing.models import BUILDERS, BlockCNN


def _coupled(model, x, loss_fn, target):
    return batch_coupled_ops(capture(model, (x,), loss_fn=loss_fn, target=target))


def test_training_batch_norm_is_reported_with_node_and_module():
    model = BlockCNN()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    found = _coupled(model, x, F.cross_entropy, y)
    assert [(c.node, c.module) for c in found] == [("batch_norm", "blocks.0.bn"), ("batch_norm_1", "blocks.1.bn")]
    assert "blocks.0.bn" in found[0].describe() and "BatchNorm" in found[0].describe()
    model.eval()
    assert _coupled(model, x, F.cross_entropy, y) == []


def test_transformers_and_mean_losses_are_not_coupled():
    for name in ("mlp", "gpt", "hf_llama"):  # RMSNorm's mean over features, a mean cross entropy
        model, inputs, target, loss_fn = BUILDERS[name]()
        assert batch_coupled_ops(capture(model, inputs, loss_fn=loss_fn, target=target)) == [], name


class _BatchStandardize(nn.Module):
    """Normalises each feature over the batch by hand (what BatchNorm does, in plain ops)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return (h - h.mean(0)) / h.std(0)


class _SeqFirstPool(nn.Module):
    """Moves the batch to dim 1, then averages over it (and only over it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).transpose(0, 1).mean(1)


def test_reductions_over_the_batch_dimension_are_reported():
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    found = _coupled(_BatchStandardize(), x, F.mse_loss, y)
    assert {c.node for c in found} == {"mean", "std"}
    found = _coupled(_SeqFirstPool(), x, lambda out, t: F.mse_loss(out, t[0]), y)
    assert [c.node for c in found] == ["mean"]  # the batch axis followed through the transpose


def test_losses_that_do_not_average_over_microbatches_are_reported():
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    sum_loss = _coupled(nn.Linear(4, 4), x, lambda out, t: (out - t).pow(2).sum(), y)
    assert len(sum_loss) == 1 and "sum" in sum_loss[0].why  # averaged over k microsteps: 1/k of itself
    product = _coupled(nn.Linear(4, 4), x, lambda out, t: (out - t).pow(2).mean() * out.mean(), y)
    assert len(product) == 2  # a product of two batch means is not linear in the rows
    linear = _coupled(nn.Linear(4, 4), x, lambda out, t: 2 * F.mse_loss(out, t, reduction="mean") - out.mean(), y)
    assert linear == []


def test_a_class_weighted_mean_loss_is_reported_and_the_plain_one_is_not():
    """A class-weighted mean divides by its microbatch's total class weight, which no weight per microbatch
    can undo; the unweighted mean divides by its non-ignored targets, which ``runtime.step_weights`` weighs."""
    x, t = torch.randn(8, 4), torch.randint(0, 3, (8,))
    weighted = _coupled(nn.Linear(4, 3), x, lambda out, t: F.cross_entropy(out, t, weight=torch.tensor([1., 2., 3.])), t)
    assert len(weighted) == 1 and "class-weighted" in weighted[0].why
    assert _coupled(nn.Linear(4, 3), x, lambda out, t: F.cross_entropy(out, t, ignore_index=0), t) == []


class _Contrastive(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(4, 6)

    def forward(self, x, y):
        return F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).t()


def test_rows_paired_with_each_other_and_bag_offsets_are_reported():
    """CLIP's similarity matrix scores every row against every other (and its loss's classes are the rows);
    an ``EmbeddingBag``'s offsets index the whole batch's flat ids: neither splits into microbatches."""
    from autoshard.passes.capture.export import capture as trace
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    symmetric = lambda logits, t: (F.cross_entropy(logits, t) + F.cross_entropy(logits.t(), t)) / 2  # noqa: E731
    found = batch_coupled_ops(trace(_Contrastive(), (x, y), loss_fn=symmetric, target=torch.arange(8)))
    assert {c.op for c in found} >= {"aten.matmul", "aten.cross_entropy_loss"}
    assert any("pairs the rows" in c.why for c in found)

    bag = nn.EmbeddingBag(40, 8, mode="mean")
    ids, offsets = torch.randint(0, 40, (20,)), torch.tensor([0, 2, 5, 6, 10, 12, 15, 17])
    found = batch_coupled_ops(trace(bag, (ids, offsets), loss_fn=lambda out, t: out.square().mean(), target=torch.zeros(8)))
    assert [c.op for c in found] == ["aten.embedding_bag"] and "offsets" in found[0].why


def test_buffers_written_in_forward_are_reported():
    """Spectral norm's power iteration writes ``_u``/``_v`` once per forward: k times in a step of k microbatches."""
    from torch.nn.utils.parametrizations import spectral_norm
    model = nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 4))
    found = _coupled(model, torch.randn(8, 4), F.mse_loss, torch.randn(8, 4))
    assert sorted(c.why.split("'")[1] for c in found) == ["0.parametrizations.weight.0._u",
                                                           "0.parametrizations.weight.0._v"]
