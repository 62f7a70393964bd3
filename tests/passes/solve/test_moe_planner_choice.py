"""Known answers for mixture-of-experts planning (``passes/cost/moe.py``, rule ``passes/sharding/rules/moe.py``),
on meta-device HF Mixtral models in bf16 on 8 H100s, one process:

- many large experts and a large batch: the planner runs the experts expert parallel (all-to-all);
- small experts: moving tokens costs more than syncing the experts' gradients, so data parallel;
- the same big model with the router's load piled onto the first chunk of experts (``expert_load``):
  the busiest expert-parallel rank would do most of the work, so the planner leaves expert parallel.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.cost.moe import ExpertLoadError, imbalance
from autoshard.passes.sharding.rules.moe import moe_role
from autoshard.passes.spec import Strategy
from autoshard.testing.moe_check import ROLES

pytest.importorskip("transformers")


def _lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _plan(hidden, inter, experts, mesh=(8,), expert_load=None, **pins):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(num_hidden_layers=2, hidden_size=hidden, intermediate_size=inter, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=1024, num_local_experts=experts, num_experts_per_tok=2,
                        use_cache=False, router_jitter_noise=0.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.empty(64, 512, dtype=torch.long, device="meta")
    return autoshard.plan(model, mesh, example_inputs=(ids,), loss_fn=_lm_loss, example_target=ids, hardware="h100",
                          optimizer="adamw", time_limit_s=30, expert_load=expert_load, **pins)


def _roles(plan) -> set:
    mesh = plan.mesh
    return {moe_role(st, a) for name, st in plan.solution.strategies.items() if name.startswith("moe_experts")
            for a in range(len(mesh.shape))}


def test_many_large_experts_and_a_large_batch_run_expert_parallel():
    plan = _plan(1024, 4096, 32)
    assert _roles(plan) == {"expert parallel (all-to-all)"}
    assert all(str(p) == "(Shard(dim=0),)" for n, p in plan.param_placements.items() if "experts" in n)
    text = plan.summary()
    assert "mixture of experts: 2 layer(s); tokens dropped: never" in text
    assert "axis0: expert parallel (all-to-all)  x2" in text  # a 1-D mesh axis is named neutrally
    assert "expert parallel (2 MoE layers, tokens dispatched by all-to-all)" in text.splitlines()[0]  # the verdict


def test_the_verdict_names_no_expert_parallelism_when_the_experts_stay_whole():
    assert "expert parallel" not in _plan(256, 64, 8).summary().splitlines()[0]


def test_small_experts_stay_data_parallel():
    assert _roles(_plan(256, 64, 8)) == {"data parallel"}


def test_skewed_expert_load_moves_the_planner_off_expert_parallel():
    uniform = _plan(1024, 4096, 32)
    skewed = _plan(1024, 4096, 32, expert_load=[100] * 4 + [1] * 28)  # the first rank's 4 experts take 93%
    assert "expert parallel (all-to-all)" not in _roles(skewed)
    assert skewed.estimated_step_time >= uniform.estimated_step_time
    # pinned expert parallel: the busiest rank computes 93% / (1/8) = 7.4x its even share, and receives as much
    ep = {"strategies": {name: _expert_parallel() for name in ("moe_experts", "moe_experts_1")}}
    even, busy = _plan(1024, 4096, 32, **ep), _plan(1024, 4096, 32, expert_load=[100] * 4 + [1] * 28, **ep)
    assert _roles(busy) == {"expert parallel (all-to-all)"}
    assert busy.solution.time_breakdown["compute"] > 2 * even.solution.time_breakdown["compute"]
    assert busy.solution.time_breakdown["communication"] > 2 * even.solution.time_breakdown["communication"]


def _expert_parallel() -> Strategy:
    role = ROLES["ep"]
    return Strategy(tuple((p,) for p in role[0]), ((role[1],),), (role[2],))


def test_imbalance_is_the_busiest_chunk_times_the_chunk_count():
    assert imbalance(None, 8) == 1.0
    assert imbalance([0.25] * 4, 2) == pytest.approx(1.0)
    assert imbalance([0.4, 0.3, 0.2, 0.1], 2) == pytest.approx(1.4)
    assert imbalance([0.4, 0.3, 0.2, 0.1], 1) == 1.0


def test_bad_expert_load_names_the_cause():
    with pytest.raises(ExpertLoadError, match="give 8 non-negative token counts"):
        _plan(256, 64, 8, expert_load=[1.0] * 7)
    with pytest.raises(ExpertLoadError, match="MoE layers 0..1"):
        _plan(256, 64, 8, expert_load={5: [1.0] * 8})


def test_measured_expert_load_feeds_the_planner():
    from autoshard.passes.cost.moe import EXPERT_LOAD_META, moe_nodes
    from autoshard.testing.hf_zoo import build
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build("mixtral")
    load = autoshard.measure_expert_load(model, [inputs, inputs])
    tokens, k = inputs["input_ids"].numel(), 2
    assert sorted(load) == [0, 1] and all(len(v) == 4 and sum(v) == 2 * tokens * k for v in load.values())
    plan = autoshard.plan(model, (2,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu", expert_load=load, time_limit_s=10)
    nodes = moe_nodes(plan.captured.gm)
    assert [sum(n.meta[EXPERT_LOAD_META]) for n in nodes] == pytest.approx([1.0, 1.0])
    assert nodes[0].meta[EXPERT_LOAD_META] == pytest.approx([c / sum(load[0]) for c in load[0]])
    with pytest.raises(ValueError, match="no MoE experts module"):
        autoshard.measure_expert_load(build("llama")[0], [build("llama")[1]])
