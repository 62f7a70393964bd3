"""``benchmarks/moe_breakdown.py`` (``published_moe_layouts.py --breakdown``) re-prices the plan it is
given: on a small Qwen3-MoE under ``fsdp(ep=2)`` with accumulation, its compute kinds add up to the
solution's own compute, and it names the expert GEMMs and the all-to-all the MoE layer's lowering runs."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import autoshard
from autoshard import layouts

transformers = pytest.importorskip("transformers")


def test_breakdown_reprices_the_plans_compute_and_names_the_moe_parts():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    from moe_breakdown import breakdown_parts
    from autoshard.testing.models import hf_lm_loss
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=1, hidden_size=128, intermediate_size=256,
                                      moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                                      use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    ids = torch.empty(8, 64, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (2,), example_inputs=(ids,), loss_fn=hf_lm_loss, example_target=ids, hardware="h100",
                          layout=layouts.fsdp(ep=2, microbatch_size=2), time_limit_s=5,
                          mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16))
    assert plan.accumulation == 2
    parts, lines = breakdown_parts(plan)
    assert parts["compute: expert GEMMs (moe_experts)"] > 0 and parts["compute: attention"] > 0
    assert parts["collective: all_to_all (op lowering, axis 0)"] > 0
    compute = sum(v for k, v in parts.items() if k.startswith(("compute:", "memory-bound:", "launch", "params: opt")))
    assert compute == pytest.approx(plan.solution.time_breakdown["compute"], rel=0.02)
    assert len(lines) == 1
