"""Models with opaque calls train like one device on 4 gloo ranks (issue 31, items 1 and 3).

- a straight-through quantiser (a custom ``torch.autograd.Function``: ``round`` forward, identity
  backward) on a (2, 2) mesh and under ``pp=2``: the Function's own backward runs (traced through, the
  layers before it would get zero gradients and the parameters end 1e-2 away);
- a loss whose internals are data-dependent (``F.ctc_loss``) on (2, 2): the loss runs as written on the
  gathered output; Hugging Face's ``Wav2Vec2ForCTC`` in the slow tier.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard.testing.equivalence import Tolerance, failures_of, train_against_one_device
from autoshard.testing.opaque_models import ctc_loss_of_logits, ctc_model, ste_mlp
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=2e-5)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _train(label, build, world, **options) -> list:
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build()
    cm = autoshard.compile(model, (2, world // 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                           hardware="cpu", time_limit_s=5, **options)
    if cm.plan.pipelined != bool(options.get("pp")):
        return [f"{label}: compiled to a plan with pipelined={cm.plan.pipelined}, asked pp={options.get('pp')}"]
    return train_against_one_device(label, cm, copy.deepcopy(model), (inputs, target), loss_fn=loss_fn, steps=2,
                                    tol=TOL, optimizer=_sgd)


def opaque_worker(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    failures = _train("straight-through (2, 2)", ste_mlp, world)
    failures += _train("straight-through pp=2", ste_mlp, world, pp=2, microbatches=2)
    failures += _train("ctc loss (2, 2)", ctc_model, world)
    return failures


def test_custom_function_and_ctc_loss_train_like_one_device():
    failures = failures_of(run_ranks(opaque_worker, 4, timeout=400))
    assert not failures, "\n".join(failures)


def wav2vec2_ctc():
    """A tiny ``Wav2Vec2ForCTC`` on 8 clips of 400 samples, CTC over its logits (labels padded with -100)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    config = Wav2Vec2Config(vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                            mask_time_prob=0.0, final_dropout=0.0, pad_token_id=0)
    labels = torch.randint(1, 12, (8, 6))
    labels[::2, 4:] = -100
    return (Wav2Vec2ForCTC(config), (torch.randn(8, 400),), labels,
            lambda out, y: ctc_loss_of_logits(out.logits, y))


def wav2vec2_worker(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    return _train("Wav2Vec2ForCTC with F.ctc_loss (2, 2)", wav2vec2_ctc, world)


@pytest.mark.slow  # a transformers speech model planned and trained on 4 ranks: about a minute on 2 loaded cores
def test_wav2vec2_for_ctc_trains_like_one_device():
    failures = failures_of(run_ranks(wav2vec2_worker, 4, timeout=400))
    assert not failures, "\n".join(failures)
