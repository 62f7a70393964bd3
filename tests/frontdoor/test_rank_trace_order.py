"""Ranks whose traces come out in different orders run rank 0's program (issue 31, item 2).

ModernBERT loops over ``set(config.layer_types)``; under torchrun every process has its own string hash
seed, so ranks traced the rotary embeddings in different orders under swapped names, and the two ranks
of one pipeline stage waited in different collectives (``pp=2`` hung in its first step). Ranks here
are forked from one process and share a hash seed, so the tests give odd ranks the other order
explicitly: ModernBERT's ``set`` is replaced there by one iterating in reverse order, and a small
model picks its branch order by rank. ``autoshard.rank_traces`` aligns every rank's trace to rank 0's.
"""
from __future__ import annotations

import builtins
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture.align import align, structural_keys
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import TraceMismatchError
from autoshard.testing.equivalence import NoiseFloor, Tolerance, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks


class TwoBranches(nn.Module):
    """Two independent branches (each a linear and a sum) whose trace order ``first`` chooses."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, d)
        self.first = "a"

    def forward(self, x):
        order = ("a", "b") if self.first == "a" else ("b", "a")
        out = {name: torch.tanh(getattr(self, name)(x)) for name in order}
        return self.head(out["a"] * 2 + out["b"])


def _trace(first: str):
    torch.manual_seed(0)
    model = TwoBranches()
    model.first = first
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return model, capture(model, (x,), loss_fn=F.mse_loss, target=y), x, y


def test_align_puts_a_trace_into_another_traces_order_and_names():
    _, reference, x, y = _trace("a")
    _, other, _, _ = _trace("b")
    assert [n.name for n in other.gm.graph.nodes] != [n.name for n in reference.gm.graph.nodes] or \
        [str(n.args) for n in other.gm.graph.nodes] != [str(n.args) for n in reference.gm.graph.nodes]
    aligned = align(other, structural_keys(reference))
    assert structural_keys(aligned) == structural_keys(reference)
    assert [(n.name, str(n.target), str(n.args)) for n in aligned.gm.graph.nodes] == \
        [(n.name, str(n.target), str(n.args)) for n in reference.gm.graph.nodes]
    assert align(reference, structural_keys(reference)) is reference


def test_align_refuses_a_different_program():
    _, reference, _, _ = _trace("a")
    torch.manual_seed(0)
    other = capture(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(8, 8),), loss_fn=F.mse_loss,
                    target=torch.randn(8, 8))
    with pytest.raises(TraceMismatchError, match="another program than rank 0"):
        align(other, structural_keys(reference))


def _branch_order_worker(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TwoBranches()
    model.first = "a" if dist.get_rank() % 2 == 0 else "b"
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    failures = []
    for label, options in (("(2, 2)", dict(mesh=(2, 2), random_seed=3)), ("pp=2", dict(mesh=(4,), pp=2, microbatches=2))):
        mesh = options.pop("mesh")
        cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                               hardware="cpu", time_limit_s=5, **options)
        failures += train_against_one_device(f"branch order by rank, {label}", cm, copy.deepcopy(reference), ((x,), y),
                                             loss_fn=F.mse_loss, steps=2, tol=Tolerance(rtol=1e-4, atol=1e-5),
                                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return failures


def test_ranks_tracing_in_different_orders_train_as_one_device():
    failures = failures_of(run_ranks(_branch_order_worker, 4, timeout=300))
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def _set_order_of_this_rank():
    """ModernBERT's ``set(...)`` iterating as another hash seed would make it on odd ranks."""
    import transformers.models.modernbert.modeling_modernbert as modeling
    reverse = dist.get_rank() in (1, 2)
    modeling.set = lambda items: sorted(builtins.set(items), reverse=reverse)
    try:
        yield
    finally:
        del modeling.set


def _modernbert():
    from transformers import ModernBertConfig, ModernBertForMaskedLM
    from autoshard.testing.models import hf_lm_loss
    torch.manual_seed(0)
    config = ModernBertConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                              vocab_size=96, max_position_embeddings=32, global_attn_every_n_layers=2,
                              local_attention=4, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    ids = torch.randint(3, 96, (8, 8))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(8, 8, dtype=torch.long)}
    return ModernBertForMaskedLM(config), inputs, torch.randint(3, 96, (8, 8)), hf_lm_loss


def _modernbert_worker(rank: int, world: int, schedule: str) -> list:
    torch.set_num_threads(1)
    model, inputs, target, loss_fn = _modernbert()
    reference = copy.deepcopy(model)
    with _set_order_of_this_rank():
        cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", time_limit_s=10, pp=2, microbatches=2, schedule=schedule)
        return train_against_one_device(f"ModernBERT pp=2 {schedule}", cm, reference, (inputs, target),
                                        loss_fn=loss_fn, steps=3, tol=NoiseFloor(),
                                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b"])  # interleaved-1f1b passes too (about 90 s more on a loaded machine)
def test_modernbert_pp2_trains_as_one_device(schedule):
    pytest.importorskip("transformers")
    failures = failures_of(run_ranks(_modernbert_worker, 4, schedule, timeout=500))
    assert not failures, "\n".join(failures)
