"""What ``loss_fn`` receives and what ``cm(x)`` returns: exactly what the model returns.

In one process: ``loss_fn`` gets the model's own output object (an HF ``ModelOutput``, a dataclass, a
dict), and an exception the loss raises is reported as the loss's, with its type and the loss's
file:line (not as a tracing limit of the model). On 4 gloo ranks ((2, 2)): an HF Llama trained with
the loss a plain-PyTorch user writes, ``F.cross_entropy(out.logits.flatten(0, 1), y.flatten())``,
equals one device; forward-only plans return the model's own output type with every tensor full on
every rank (a dataclass with a constant field, and Whisper's ``Seq2SeqLMOutput`` with its encoder state).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.errors import TraceError
from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks


@dataclasses.dataclass
class DenoiseOutput:
    """A diffusers-style output dataclass."""
    sample: torch.Tensor
    extras: dict
    scale: float = 0.5


class Denoiser(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return DenoiseOutput(self.fc2(h), {"hidden": h, "mean": h.mean(-1), "none": None})


def _llama():
    from autoshard.testing.models import hf_llama
    torch.manual_seed(0)
    return hf_llama()


def test_loss_fn_receives_the_models_own_output_object():
    seen = []

    def loss(out, y):
        seen.append(type(out).__name__)
        return F.mse_loss(out.sample, y) + out.extras["mean"].mean() * out.scale

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    cg = capture(Denoiser(), (x,), loss_fn=loss, target=y)
    assert cg.loss_output and seen and set(seen) == {"DenoiseOutput"}

    model, inputs, target, _ = _llama()
    kinds = []
    hf_loss = lambda out, t: (kinds.append(type(out).__name__),  # noqa: E731
                              F.cross_entropy(out.logits.flatten(0, 1), t.flatten()))[1]
    cg = capture(model, inputs, loss_fn=hf_loss, target=target)
    assert set(kinds) == {"CausalLMOutputWithPast"}
    got = cg.gm(*model.parameters(), *model.buffers(), inputs["input_ids"], target)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, F.cross_entropy(model(**inputs).logits.flatten(0, 1), target.flatten()))


def test_an_error_in_the_loss_is_named_as_the_loss_s():
    model, inputs, target, _ = _llama()
    typo = lambda out, y: F.cross_entropy(out.logit.flatten(0, 1), y.flatten())  # noqa: E731
    with pytest.raises(TraceError) as info:
        capture(model, inputs, loss_fn=typo, target=target)
    text = str(info.value)
    assert text.startswith("loss_fn raised AttributeError:") and "logit" in text
    assert f"{__file__}:" in text and "out.logit.flatten" in text
    assert "construct the tracers do not support" not in text

    def wrong_shape(out, y):
        return F.cross_entropy(out.logits, y)  # (8, 16, 64) against (8, 16): no flatten
    with pytest.raises(TraceError, match=r"^loss_fn raised (RuntimeError|ValueError)") as info:
        capture(model, inputs, loss_fn=wrong_shape, target=target)
    assert "in wrong_shape" in str(info.value)


def test_a_forward_only_capture_keeps_every_output_tensor_and_the_structure():
    torch.manual_seed(0)
    model, x = Denoiser(), torch.randn(8, 16)
    cg = capture(model, (x,))
    assert not cg.loss_output and cg.output_structure is not None
    flat = cg.gm(*model.parameters(), x)
    out = cg.output_structure.rebuild(flat)
    want = model(x)
    assert type(out) is DenoiseOutput and out.scale == 0.5 and out.extras["none"] is None
    torch.testing.assert_close(out.sample, want.sample)
    torch.testing.assert_close(out.extras["hidden"], want.extras["hidden"])
    torch.testing.assert_close(out.extras["mean"], want.extras["mean"])


def outputs_worker(rank: int, world: int) -> list:
    import autoshard
    from autoshard.testing.hf_zoo import build

    torch.set_num_threads(1)
    failures = []
    # training an HF model with the loss a plain-PyTorch user writes
    model, inputs, target, _ = _llama()
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    cm = autoshard.compile(model, (2, 2), example_inputs=inputs, loss_fn=loss, example_target=target,
                           hardware="cpu", time_limit_s=20)
    failures += train_against_one_device("hf_llama out.logits loss", cm, copy.deepcopy(model), (inputs, target),
                                         loss_fn=loss, steps=2, tol=Tolerance(rtol=1e-4, atol=2e-5),
                                         optimizer=adamw(lr=1e-3))
    # forward-only: the model's own output types, every tensor full on every rank
    torch.manual_seed(0)
    denoiser, x = Denoiser(), torch.randn(8, 16)
    cm = autoshard.compile(denoiser, (2, 2), example_inputs=(x,), hardware="cpu", time_limit_s=20,
                           params={"fc1.weight": ("R", "S(0)"), "fc2.weight": ("R", "S(1)")})
    got, want = cm(x), denoiser(x)
    if type(got) is not DenoiseOutput or got.scale != 0.5 or got.extras["none"] is not None:
        failures.append(f"denoiser: got {got!r}")
    else:
        for name, g, w in (("sample", got.sample, want.sample), ("hidden", got.extras["hidden"], want.extras["hidden"]),
                           ("mean", got.extras["mean"], want.extras["mean"])):
            if g.shape != w.shape or not torch.allclose(g, w, rtol=1e-5, atol=1e-6):
                failures.append(f"denoiser {name}: {tuple(g.shape)} differs from the model's {tuple(w.shape)}")
    torch.manual_seed(0)
    whisper, inputs, _, _ = build("whisper")
    cm = autoshard.compile(whisper, (2, 2), example_inputs=inputs, hardware="cpu", time_limit_s=20)
    got = cm(**inputs)
    with torch.no_grad():
        want = whisper(**inputs)
    if type(got) is not type(want) or list(got.keys()) != list(want.keys()):
        failures.append(f"whisper: got {type(got).__name__} {list(getattr(got, 'keys', list)())}, "
                        f"want {type(want).__name__} {list(want.keys())}")
    else:
        for key in want.keys():
            if not torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5):
                failures.append(f"whisper {key}: differs from the model's")
    return failures


@pytest.mark.slow  # three compiles on 4 ranks, Whisper among them: about 2 minutes on 2 loaded cores
def test_hf_loss_trains_like_one_device_and_forward_only_returns_the_models_output():
    failures = failures_of(run_ranks(outputs_worker, 4, timeout=400))
    assert not failures, "\n".join(failures)
