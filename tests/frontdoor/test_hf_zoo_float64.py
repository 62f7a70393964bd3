"""The Hugging Face zoo in float64: model, inputs and the one-device reference all in double precision,
where a correct plan agrees with one device to rounding (1e-9 relative is a millionfold above it), so a
difference here is a bug, never noise. This is how a ring-attention path that computed float64 inputs
in float32 was found (its CLIP plans were off by 2e-7).

Models that compute parts in float32 whatever their dtype (Hugging Face's RMSNorm and T5's layer norm,
Mixtral's router softmax) run with those parts computing in the input's dtype instead: there the two
sides legitimately differ by float32 ulps (a plan that splits the work rounds a partial gradient to
float32 per rank and then sums, one device rounds the whole sum once), which the float64 tolerance
cannot tell from a bug; ``zoo_captures`` refuses a float64 model with such an op on a gradient path
(``narrower_on_gradient_path``). The MoE models whose experts call ``torch._grouped_mm`` (no float64
kernel) are not in this sweep.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from autoshard.testing.zoo_check import FLOAT64_TOL, narrower_on_gradient_path, run_zoo  # noqa: E402

MODELS = ["bert", "bart", "whisper", "vit", "clip", "gpt2", "gpt_neox", "opt", "llama", "t5", "falcon",
          "phi", "mixtral_batched"]


def _float32_parts_in_input_dtype(set_attr=setattr) -> None:
    """HF's RMS norms and Mixtral's router without their float32 casts (same formulas, the input's own
    dtype); ``set_attr`` replaces each class's ``forward`` (a test passes ``monkeypatch.setattr``)."""
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.t5 import modeling_t5

    def rms(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for cls in (modeling_llama.LlamaRMSNorm, modeling_t5.T5LayerNorm, modeling_mixtral.MixtralRMSNorm):
        set_attr(cls, "forward", rms)

    def route(self, hidden_states):  # MixtralTopKRouter.forward with softmax(router_logits), no .float()
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top_value, top_index = torch.topk(F.softmax(router_logits, dim=-1), self.top_k, dim=-1)
        top_value /= top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value, top_index
    set_attr(modeling_mixtral.MixtralTopKRouter, "forward", route)


@pytest.fixture(scope="module")
def results():
    # the patch is made in the process that captures; the ranks fork from it and train with it
    return run_zoo(MODELS, 4, steps=2, dtype=torch.float64, tol=FLOAT64_TOL, setup=_float32_parts_in_input_dtype,
                   timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_matches_one_device_in_float64(results, name):
    r = results[name]
    assert r.status == "ok", "\n".join(r.failures[:10])


class _RoutedInFloat32(torch.nn.Module):
    """A float64 model whose router scores are computed in float32 (as Mixtral's are), next to a float32
    table computed from a buffer only (as rotary embeddings are): not on any gradient path."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(8, 4, dtype=torch.float64)
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.register_buffer("freq", torch.arange(8, dtype=torch.float64))

    def forward(self, x):
        scores = torch.softmax(self.router(x).float(), dim=-1)
        table = torch.cos(self.freq.float()).to(x.dtype)
        return self.proj(x * table) * scores.sum(-1, keepdim=True)


def test_float64_premise_finds_float32_ops_on_gradient_paths_only():
    from autoshard.passes.capture.export import capture
    x = torch.randn(4, 8, dtype=torch.float64)
    captured = capture(_RoutedInFloat32(), (x,), loss_fn=lambda out, t: ((out - t) ** 2).mean(), target=torch.zeros(4, 8, dtype=torch.float64))
    found = narrower_on_gradient_path(captured, torch.float64)
    assert found and all("float32" in f for f in found), found
    assert any("softmax" in f for f in found) and not any("cos" in f for f in found), found
    assert narrower_on_gradient_path(captured, torch.float32) == []


def test_float64_sweep_runs_mixtral_in_float64(monkeypatch):
    """Mixtral's router softmax casts to float32; under a plan that splits the experts' output, the router
    weights' gradient is then cast to float32 per rank before the ranks' parts are summed, so the float64
    sweep saw float32 ulps (1.2e-10 on embed_tokens' gradient, random plan seed 2) that were not a bug. The
    sweep runs Mixtral with that softmax in float64."""
    from autoshard.passes.capture.export import capture
    from autoshard.testing.hf_zoo import build
    _float32_parts_in_input_dtype(monkeypatch.setattr)
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build("mixtral_batched")  # token ids in, token ids as the target
    captured = capture(model.double(), inputs, loss_fn=loss_fn, target=target)
    assert narrower_on_gradient_path(captured, torch.float64) == []
