"""The plan is chosen among the lever search's finalists by the overlap model's step (issue 16 item 3).

The ranking cases are real plans of one program (a meta Llama, hidden 4096, 4 layers, batch 8 x 256
on 8 H100s whose links run at a quarter of NVLink's bandwidth): autoshard's own plan and four published layouts (Megatron tp=2 and tp=8, FSDP with and
without reshard-after-forward). Among them, some pairs are ranked one way by the ILP's additive sum
and the other way by the overlap model (more of one plan's communication hides under compute on the
communication stream). Fed to ``pick_finalist`` in the order the lever search finds incumbents (each
additively better than the one before), the overlap winner is picked, and the record says the
additive choice was changed.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.solve.finalists import overlapped_step, pick_finalist
from autoshard.testing.models import hf_lm_loss


@pytest.fixture(scope="module")
def plans():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11264, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False,
                      use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.empty(8, 256, dtype=torch.long, device="meta")
    # links of a quarter of NVLink's bandwidth: enough communication for the two models to rank plans apart
    # (on the h100 preset's own links, since the optimizer step and the kernel classes are priced, no two of
    # these plans do)
    slow_links = dataclasses.replace(PRESETS["h100"], name="h100-quarter-nvlink", intra_node_bandwidth=450e9 / 4)
    common = dict(example_inputs=(ids,), loss_fn=hf_lm_loss, example_target=ids, hardware=slow_links)
    found = {"ours": autoshard.plan(model, 8, **common)}
    for name, layout in {"tp2": layouts.megatron(tp=2, recompute="none", microbatch_size=2),
                         "tp8": layouts.megatron(tp=8, recompute="none", microbatch_size=8),
                         "fsdp": layouts.fsdp(checkpoint="none"),
                         "fsdp_keep": layouts.fsdp(checkpoint="none", reshard_after_forward=False)}.items():
        found[name] = autoshard.plan(model, 8, layout=layout, **common)
    return found


def test_additive_and_overlapped_rankings_differ_and_the_overlapped_winner_is_picked(plans):
    disagreeing = [(a, b) for a, b in itertools.permutations(plans, 2)
                   if plans[a].estimated_step_time < plans[b].estimated_step_time
                   and overlapped_step(plans[b].solution) < overlapped_step(plans[a].solution)]
    assert disagreeing, {n: (p.estimated_step_time, overlapped_step(p.solution)) for n, p in plans.items()}
    for additive_best, overlap_best in disagreeing:
        a, b = plans[additive_best].solution, plans[overlap_best].solution
        chosen, record = pick_finalist([b, a], lambda s: s)  # the search's order: the additive best last
        assert chosen is b, (additive_best, overlap_best)
        assert record["changed"] and record["count"] == 2
        assert record["chosen_overlapped_s"] == overlapped_step(b)
        assert record["additive_choice_overlapped_s"] == overlapped_step(a)


def test_equal_overlap_keeps_the_additive_choice_and_one_finalist_is_itself(plans):
    ours = plans["ours"]
    chosen, record = pick_finalist([ours.solution], lambda s: s)
    assert chosen is ours.solution and not record["changed"]
    chosen, record = pick_finalist([ours.solution, ours.solution], lambda s: s)
    assert record["changed"] is False


def test_the_planner_records_the_rescoring_and_the_summary_says_so(plans):
    ours = plans["ours"]
    rec = ours.solution.solver_stats["finalists"]
    assert rec["rescored_by"] == "overlap" and rec["count"] >= 1
    assert rec["chosen_overlapped_s"] == pytest.approx(overlapped_step(ours.solution))
    assert "chosen by the overlap model's step among" in ours.summary()
