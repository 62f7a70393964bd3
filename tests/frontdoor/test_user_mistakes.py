"""A newcomer's mistakes get errors that name the mistake, not the tracer (issue 31, items 6-8).

- A model that raises on the example inputs (a 0-d timestep where it asserts a 1-d one, a keyword
  left out that arrives as ``None``, a waveform with one axis too many) is named as such: the
  headline is the model's own exception at its line, not "Python control flow" or "a construct the
  tracers do not support" (which the fx fallback's message used to suggest). The diffusion-style
  model below raises as diffusers' DiT does on these inputs; Wav2Vec2 is transformers' own.
- A ``loss_fn`` that returns ``None`` (``lambda out, y: out.loss`` on a model given no labels), a
  tensor that is not a scalar, or a tuple is refused when planning, not at the first step.
- ``torch.unique``, ``nonzero``, boolean-mask indexing and ``masked_select`` (sizes that depend on
  values) are refused with a ``TraceError`` naming the op and the line, instead of torch's
  ``GuardOnDataDependentSymNode`` escaping from autoshard's passes.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture.eager_check import eager_error


class TimestepDenoiser(nn.Module):
    """A class-conditioned denoiser shaped like DiT's embeddings: a 1-d timestep asserted, labels read."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.labels = nn.Embedding(10, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, hidden_states, timestep, class_labels=None):
        assert len(timestep.shape) == 1, "timesteps should be a 1-d tensor"
        keep = torch.rand(class_labels.shape[0]) >= 0.0  # a keyword left out arrives as None
        emb = torch.where(keep[:, None], self.labels(class_labels), 0.0)
        return self.out(self.inp(hidden_states) + emb + timestep[:, None].float())


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("inputs, raised, line", [
    (dict(hidden_states=torch.randn(4, 8), timestep=torch.tensor(5), class_labels=torch.arange(4)),
     "AssertionError: timesteps should be a 1-d tensor", "assert len(timestep.shape)"),
    (dict(hidden_states=torch.randn(4, 8), timestep=torch.arange(4)),
     "AttributeError: 'NoneType' object has no attribute 'shape'", "class_labels.shape[0]"),
])
def test_the_model_raising_on_the_inputs_is_named_not_the_tracer(inputs, raised, line):
    with pytest.raises(autoshard.TraceError) as info:
        autoshard.plan(TimestepDenoiser(), 2, example_inputs=inputs, loss_fn=F.mse_loss,
                       example_target=torch.randn(4, 8), hardware="cpu")
    headline = str(info.value).splitlines()[0]
    assert f"an error the model's forward raises on these example inputs ({raised})" in headline
    assert f"{__file__}:{_line_of(TimestepDenoiser.forward, line)}" in headline
    assert "control flow" not in headline and "do not support" not in headline


def test_a_meta_model_raising_on_the_inputs_is_named_too():
    with torch.device("meta"):
        model = TimestepDenoiser()
    with pytest.raises(autoshard.TraceError, match=r"forward raises on these example inputs \(AssertionError"):
        autoshard.plan(model, 2, example_inputs=dict(hidden_states=torch.randn(4, 8), timestep=torch.tensor(5),
                                                     class_labels=torch.arange(4)), hardware="cpu")


def test_a_waveform_of_the_wrong_rank_is_named_as_the_models_error():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        layerdrop=0.0)
    with pytest.raises(autoshard.TraceError) as info:
        autoshard.plan(transformers.Wav2Vec2Model(config), 2, example_inputs=(torch.randn(4, 1, 400),),
                       hardware="cpu")
    headline = str(info.value).splitlines()[0]
    assert "forward raises on these example inputs (RuntimeError: Expected 2D (unbatched) or 3D" in headline
    assert "do not support" not in headline


def test_the_eager_check_leaves_the_model_as_it_was():
    class Counting(TimestepDenoiser):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(8)

        def forward(self, hidden_states, timestep, class_labels=None):
            return super().forward(self.norm(hidden_states), timestep, class_labels)

    model = Counting()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(autoshard.TraceError):
        autoshard.plan(model, 2, example_inputs=dict(hidden_states=torch.randn(4, 8), timestep=torch.tensor(5),
                                                     class_labels=torch.arange(4)), hardware="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics too
    bad_label = [torch.randn(4, 8), torch.arange(4), torch.tensor([0, 1, 2, 12])]  # fails after torch.rand
    rng = torch.get_rng_state()  # the check's draws come from a forked generator
    error = eager_error(model, bad_label, is_loss_error=lambda e: False)
    assert isinstance(error, IndexError) and torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("loss_fn, said", [
    (lambda out, y: None, r"returned None, not a loss.*pass labels in example_inputs"),
    (lambda out, y: F.mse_loss(out, y, reduction="none"), r"returned a tensor of shape \(4, 8\), not a loss"),
    (lambda out, y: (F.mse_loss(out, y), out), r"returned a tuple of 2 values, not a loss"),
    (lambda out, y: (out > y).sum(), r"returned a torch.int64 scalar, not a loss"),
])
def test_a_loss_fn_that_returns_no_scalar_loss_is_refused_when_planning(loss_fn, said):
    x = torch.randn(4, 8)
    with pytest.raises(autoshard.TraceError, match=said):
        autoshard.plan(Tagger(), 2, example_inputs=(x,), loss_fn=loss_fn, example_target=x, hardware="cpu")


class ValueSized(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        if self.how == "unique":
            picked = torch.unique(x.round())
        elif self.how == "mask":
            picked = x[x > 0]
        else:
            picked = torch.masked_select(x, x > 0)
        return self.fc(x) + picked.sum()


@pytest.mark.parametrize("how, op, line", [
    ("unique", r"aten\._unique2 \(torch\.unique\)", "torch.unique(x.round())"),
    ("mask", r"aten\.index \(boolean-mask indexing", "x[x > 0]"),
    ("select", r"aten\.masked_select", "torch.masked_select(x, x > 0)"),
])
def test_an_op_whose_size_depends_on_values_is_named_with_its_line(how, op, line):
    x = torch.randn(8, 8)
    with pytest.raises(autoshard.TraceError, match=op) as info:
        autoshard.plan(ValueSized(how), 2, example_inputs=(x,), loss_fn=F.mse_loss, example_target=x, hardware="cpu")
    message = str(info.value)
    assert f"{__file__}:{_line_of(ValueSized.forward, line)}" in message
    assert "static shapes" in message and "fix:" in message
