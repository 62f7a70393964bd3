"""The plan is chosen among the lever search's finalists by the overlap model's step (issue 16 item 3).

The ranking case is built from two real plans of one program (a meta Llama, hidden 1024, 4 layers,
batch 8 x 1024 on 8 H100s): autoshard's own plan and Megatron's tp=4 layout. The ILP's additive sum
ranks autoshard's plan first; the overlap model ranks Megatron's first (more of its communication hides
under compute on the communication stream).
Fed to ``pick_finalist`` in the order the lever search finds incumbents (each additively better than
the one before), the overlap winner is picked, and the record says the additive choice was changed.
"""
from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.passes.solve.finalists import overlapped_step, pick_finalist
from autoshard.testing.models import hf_lm_loss


@pytest.fixture(scope="module")
def two_plans():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False,
                      use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.empty(8, 1024, dtype=torch.long, device="meta")
    common = dict(example_inputs=(ids,), loss_fn=hf_lm_loss, example_target=ids, hardware="h100")
    ours = autoshard.plan(model, 8, **common)
    megatron = autoshard.plan(model, 8, layout=layouts.megatron(tp=4, recompute="none", microbatch_size=4), **common)
    return ours, megatron


def test_additive_and_overlapped_rankings_differ_and_the_overlapped_winner_is_picked(two_plans):
    ours, megatron = two_plans
    assert ours.solution.levers.accumulation == megatron.solution.levers.accumulation == 1  # one program
    # the case: the additive sum prefers autoshard's plan, the overlap model Megatron's
    assert ours.estimated_step_time < megatron.estimated_step_time
    assert overlapped_step(megatron.solution) < overlapped_step(ours.solution)
    finalists = [megatron.solution, ours.solution]  # the search's order: the additive best last
    chosen, record = pick_finalist(finalists, lambda s: s)
    assert chosen is megatron.solution
    assert record["changed"] and record["count"] == 2
    assert record["chosen_overlapped_s"] == overlapped_step(megatron.solution)
    assert record["additive_choice_overlapped_s"] == overlapped_step(ours.solution)


def test_equal_overlap_keeps_the_additive_choice_and_one_finalist_is_itself(two_plans):
    ours, _ = two_plans
    chosen, record = pick_finalist([ours.solution], lambda s: s)
    assert chosen is ours.solution and not record["changed"]
    chosen, record = pick_finalist([ours.solution, ours.solution], lambda s: s)
    assert record["changed"] is False


def test_the_planner_records_the_rescoring_and_the_summary_says_so(two_plans):
    ours, _ = two_plans
    rec = ours.solution.solver_stats["finalists"]
    assert rec["rescored_by"] == "overlap" and rec["count"] >= 1
    assert rec["chosen_overlapped_s"] == pytest.approx(overlapped_step(ours.solution))
    assert "chosen by the overlap model's step among" in ours.summary()
