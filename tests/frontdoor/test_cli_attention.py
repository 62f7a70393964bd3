"""``autoshard plan SPEC`` builds a Hugging Face model with an attention implementation it accepts
(issue 31, item 9): SDPA when the model takes it, else eager (GPT-OSS refuses SDPA for its attention
sinks, and used to be reported as having "no causal-LM class"); when none is accepted, the error says
each refusal, and a model type without a causal-LM class is still named as such."""
from __future__ import annotations

import pytest

from autoshard import cli, model_specs
from autoshard.model_specs import build_model

pytest.importorskip("transformers")

GPT_OSS = ("gpt_oss:num_hidden_layers=1,hidden_size=32,intermediate_size=32,num_attention_heads=4,"
           "num_key_value_heads=2,head_dim=8,num_local_experts=2,num_experts_per_tok=1,vocab_size=64")
LLAMA = "llama:num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=4,vocab_size=64"


def test_a_model_refusing_sdpa_is_built_with_eager_attention():
    built = build_model(GPT_OSS, batch=2, seq=8)
    assert type(built.model).__name__ == "GptOssForCausalLM"
    assert built.model.config._attn_implementation == "eager"


def test_a_model_taking_sdpa_keeps_it():
    assert build_model(LLAMA, batch=2, seq=8).model.config._attn_implementation == "sdpa"


def test_when_no_attention_is_accepted_the_refusals_are_the_error(monkeypatch, capsys):
    monkeypatch.setattr(model_specs, "ATTENTION_IMPLEMENTATIONS", ("sdpa",))
    assert cli.main(["plan", GPT_OSS, "--mesh", "2", "--batch", "2", "--seq", "8", "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert "accepts none of the attention implementations" in err and "'sdpa': GptOssForCausalLM does not support" in err
    assert "no causal-LM class" not in err


def test_a_model_type_without_a_causal_lm_class_is_named_as_such():
    with pytest.raises(ValueError, match="model type 't5' has no causal-LM class"):
        build_model("t5:d_model=32", batch=2, seq=8)
