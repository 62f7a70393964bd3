"""Microbatches with different numbers of padded targets train as one device's batch.

``F.cross_entropy`` divides by the targets that are not ``ignore_index``. Before ``runtime.step_weights``
a step of k microbatches averaged k microbatch means with weight 1/k: with padding spread unevenly over
the batch (causal-LM batches always are), accumulation and pipelines computed another loss (4.0061 on
one device, 3.9899 under ``pp=2`` here) and other gradients, silently. Now each microbatch weighs its
share of the step's count. On 4 gloo ranks, mesh (2, 2), float64, a padded LM: gradient accumulation 2,
a 2-group pipeline, and the pipeline fed ``local_batch=True`` slices (counts summed over the world),
3 SGD steps each: loss at every step and the full state dict equal one device's. One process checks
``passes.loss_counts`` (which losses count, the counting program, when one weight per microbatch is
exact) and ``StepWeights`` (equal counts keep ``1/k``; a loss with another term warns instead of
weighing).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.equivalence import Tolerance, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-9, atol=1e-10, grad_atol=1e-10)


class PaddedLM(nn.Module):
    def __init__(self, vocab: int = 40, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def token_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def build():
    torch.manual_seed(0)
    ids, target = torch.randint(0, 40, (8, 6)), torch.randint(0, 40, (8, 6))
    target[:3, 1:] = -100  # the first microbatches are mostly padding, the last hardly any
    target[6, 3:] = -100
    return PaddedLM().double(), (ids,), target, token_loss


class LocalSlices:
    """``cm`` stepped with each rank's data-parallel slice (``local_batch=True``) of the full batch."""

    def __init__(self, cm):
        self.cm = cm

    def _slice(self, t):
        n = t.shape[0] // self.cm.data_parallel_size
        return t[self.cm.data_parallel_rank * n:(self.cm.data_parallel_rank + 1) * n]

    def step(self, *inputs, target):
        return self.cm.step(*(self._slice(x) for x in inputs), target=self._slice(target), local_batch=True)

    def parameters(self):
        return self.cm.parameters()

    def full_state_dict(self):
        return self.cm.full_state_dict()


CASES = [("accumulation=2", {"accumulation": 2}, False), ("pp=2", {"pp": 2}, False),
         ("pp=2 local_batch", {"pp": 2}, True)]


def worker(rank: int, world: int, cases) -> list[str]:
    import autoshard
    torch.set_num_threads(1)
    failures = []
    for label, options, local in cases:
        model, inputs, target, loss_fn = build()
        reference = copy.deepcopy(model)
        cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", **options)
        program = LocalSlices(cm) if local else cm
        failures += train_against_one_device(f"padded LM {label}", program, reference, (inputs, target),
                                             loss_fn=loss_fn, steps=3, tol=TOL,
                                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return failures


def test_padded_microbatches_train_as_one_batch():
    failures = failures_of(run_ranks(worker, 4, CASES))
    assert not failures, "\n".join(failures)


def _capture(model, inputs, target, loss_fn):
    from autoshard.passes.capture.export import capture
    return capture(model, inputs, loss_fn=loss_fn, target=target)


def test_loss_counts_find_the_mean_class_loss_and_count_its_targets():
    from autoshard.passes.loss_counts import loss_counts

    model, inputs, target, loss_fn = build()
    counts = loss_counts(_capture(model, inputs, target, loss_fn))
    assert len(counts.programs) == 1 and counts.exact
    assert int(counts.programs[0](*inputs, target)) == int((target != -100).sum()) == 48 - 15 - 3

    # Hugging Face computes the loss inside the model from labels it shifts and pads: still counted
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=32, use_cache=False))
    ids = torch.randint(0, 32, (4, 6))
    labels = ids.clone()
    labels[0, 2:] = -100
    hf = loss_counts(_capture(llama, {"input_ids": ids, "labels": labels}, labels, lambda out, t: out.loss))
    assert hf.exact and len(hf.programs) == 1
    assert int(hf.programs[0](ids, labels, labels)) == int((labels[:, 1:] != -100).sum())  # shifted by one

    # a sum, soft targets or another loss: nothing to count; an added term: counted, not exact
    for fn in (lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum"),
               lambda out, t: F.mse_loss(out, torch.zeros_like(out))):
        assert not loss_counts(_capture(copy.deepcopy(model), inputs, target, fn))
    with_aux = loss_counts(_capture(copy.deepcopy(model), inputs, target,
                                    lambda out, t: token_loss(out, t) + 0.1 * out.square().mean()))
    assert with_aux and not with_aux.exact


def test_step_weights_keep_equal_counts_and_warn_on_a_loss_they_cannot_weigh():
    from autoshard.passes.errors import BatchCouplingWarning
    from autoshard.runtime.step_weights import StepWeights

    model, inputs, target, loss_fn = build()
    mb = [slice(0, 4), slice(4, 8)]
    captured = _capture(model, tuple(x[:4] for x in inputs), target[:4], loss_fn)
    weights = StepWeights(captured, "cpu", 2)
    user, targets = [[inputs[0][s] for s in mb]], [target[s] for s in mb]
    n = [int((target[s] != -100).sum()) for s in mb]
    assert weights(user, targets) == [n[0] / sum(n), n[1] / sum(n)]
    unpadded = torch.randint(0, 40, (8, 6))
    assert weights(user, [unpadded[s] for s in mb]) is None  # equal counts: 1/k, the path without padding

    aux = _capture(copy.deepcopy(model), tuple(x[:4] for x in inputs), target[:4],
                   lambda out, t: token_loss(out, t) + 0.1 * out.square().mean())
    with pytest.warns(BatchCouplingWarning, match="cross_entropy"):
        assert StepWeights(aux, "cpu", 2)(user, targets) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StepWeights(aux, "cpu", 2)(user, [unpadded[s] for s in mb])  # equal counts: nothing to say
