"""``autoshard.plan(..., layout=L)`` prices exactly the layout asked for (issue 16 item 5).

Meta-device models, one process: the GPT toy of ``autoshard.testing.models`` and a tiny Hugging Face
Llama. For a Megatron layout every parameter's placement is checked against what Megatron-LM does
(column-parallel q/k/v/fc/gate/up and head split on output features, row-parallel o/out/down on
input features, the token embedding vocab-parallel, everything else replicated over tp, replicated
over dp), the norms' outputs sequence-split over tp, the levers (microsteps = batch / (dp x
microbatch size), the recompute policy), and for a pipelined layout pp, the schedule, the microbatch
count and each stage's (dp, tp) submesh. Bad layouts get a ``LayoutError`` naming the cause.
"""
from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.layouts import LayoutError
from autoshard.passes.spec import Replicate, Shard
from autoshard.testing.models import GPT, hf_lm_loss, lm_loss

R, S0, S1 = Replicate(), Shard(0), Shard(1)
BATCH, SEQ = 8, 16


def gpt_meta(layers: int = 2, heads: int = 4):
    with torch.device("meta"):
        return GPT(64, 32, layers, heads, SEQ, tied=True)


def llama_meta():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=SEQ, tie_word_embeddings=False,
                      use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def ids():
    return torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")


def plan_gpt(layout, mesh=(4, 2), model=None):
    x = ids()
    return autoshard.plan(model or gpt_meta(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                          hardware="h100", layout=layout)


def megatron_gpt_expected(name: str) -> tuple:
    """Megatron-LM's tp placement of each GPT toy parameter (dp axis replicated); the head is tied to wte."""
    leaf = name.split(".")[-2:]
    if name in ("wte.weight", "head.weight") or leaf in (["q", "weight"], ["k", "weight"], ["v", "weight"], ["fc", "weight"],
                                        ["fc", "bias"]):
        return (R, S0)
    if leaf in (["o", "weight"], ["out", "weight"]):
        return (R, S1)
    return (R, R)  # position embedding, norms, row-parallel biases


def test_megatron_gpt_placements_levers_exactly_as_asked():
    layout = layouts.megatron(tp=2, microbatch_size=2, recompute="selective")
    plan = plan_gpt(layout)
    assert plan.mesh.shape == (4, 2)
    placements = plan.param_placements
    assert set(placements) >= {n for n, _ in gpt_meta().named_parameters()}
    for name, pls in placements.items():
        assert tuple(pls) == megatron_gpt_expected(name), name
    levers = plan.solution.levers
    assert levers.accumulation == BATCH // (4 * 2)
    assert {t: p.checkpoint for t, p in levers.blocks.items()} == {"blocks.#": "selective"}
    # sequence parallel: each norm feeding column-parallel matmuls outputs its sequence split over tp
    norms = [n for n in plan.captured.gm.graph.nodes if n.op == "call_function" and "layer_norm" in n.name]
    assert norms
    for n in norms:
        assert tuple(plan.strategies[n.name].outputs[0]) == (S0, S1), n.name
    assert plan.solution.solver_stats["layout"] == layout.describe()


def test_megatron_without_sequence_parallel_keeps_norms_replicated_over_tp():
    plan = plan_gpt(layouts.megatron(tp=2, sequence_parallel=False, recompute="none"))
    for n in plan.captured.gm.graph.nodes:
        if n.op == "call_function" and "layer_norm" in n.name:
            assert tuple(plan.strategies[n.name].outputs[0])[1] != S1, n.name
    assert plan.solution.levers.accumulation == BATCH // 4
    assert all(p.checkpoint == "none" for p in plan.solution.levers.blocks.values())


def _zero1_over_dp(plan) -> None:
    """Every stage of ``plan`` computes with its parameters replicated over dp (Megatron's tp placements)
    and stores them ``R/zero1`` there: ZeRO-1, the optimizer state sharded over dp, priced as such. A
    parameter whose tp slice has no dim dp divides without nesting outside tp's split (``fc.bias``, split
    on its only dim by tp) stays plain ``R`` (``storage_forms.zero_dim``)."""
    from autoshard.passes.sharding.storage_forms import zero_dim
    captured = plan.captured
    for stage in plan.stages:
        for ph, fqn in captured.params.items():
            if ph not in stage.solution.strategies:
                continue
            st = stage.solution.strategies[ph]
            assert tuple(st.outputs[0]) == megatron_gpt_expected(fqn), fqn
            shape = captured.node(ph).meta["autoshard.meta"].shape
            can = zero_dim(shape, st.outputs[0], (0,), stage.solution.mesh.shape) is not None
            assert tuple(st.lowerings) == (("zero1", None) if can else (None, None)), (fqn, st.lowerings)


def test_megatron_distributed_optimizer_is_zero1_over_dp():
    """``distributed_optimizer=True`` is ZeRO-1 (compute copies replicated, optimizer state sharded over
    dp), with and without a pipeline; its memory is the plain layout's less half the optimizer state (dp 2),
    its step about the same (reduce-scatter + all-gather move the all-reduce's bytes)."""
    for pp, kw in ((1, dict(microbatch_size=2)), (2, {})):
        model = (lambda: gpt_meta(layers=4)) if pp > 1 else gpt_meta
        plain = plan_gpt(layouts.megatron(tp=2, pp=pp, recompute="none", **kw), model=model())
        plan = plan_gpt(layouts.megatron(tp=2, pp=pp, recompute="none", distributed_optimizer=True, **kw),
                        model=model())
        _zero1_over_dp(plan)
        assert "ZeRO-1" in plan.summary().splitlines()[0] and "ZeRO" not in plain.summary().splitlines()[0]
        for a, b in zip(plain.stages, plan.stages):
            # dp = 2 halves the optimizer state; the unreduced gradient stays whole (held until the step's
            # reduce-scatter), so the saving is about half the optimizer state
            saved = a.solution.estimated_memory - b.solution.estimated_memory
            assert saved >= 0.45 * a.solution.memory_breakdown["optimizer"], (pp, a.index, saved)
            assert b.solution.estimated_step_time == pytest.approx(a.solution.estimated_step_time, rel=0.1)


def test_fsdp_and_hsdp_placements_and_levers():
    plan = plan_gpt(layouts.fsdp(checkpoint="full"), mesh=8)
    assert plan.mesh.shape == (8,)
    for name, pls in plan.param_placements.items():
        assert tuple(pls) == (S0,), name
    assert plan.solution.levers.accumulation == 1
    assert {t: p.checkpoint for t, p in plan.solution.levers.blocks.items()} == {"blocks.#": "full"}
    hsdp = plan_gpt(layouts.fsdp(replicas=2, reshard_after_forward=False), mesh=(2, 4))
    assert hsdp.mesh.axis_names == ("replica", "dp")
    for name, pls in hsdp.param_placements.items():
        assert tuple(pls) == (R, S0), name
    assert all(not p.reshard_after_forward for p in hsdp.solution.levers.blocks.values())


@pytest.mark.parametrize("pp", [1, 2])
def test_megatron_on_hf_llama_found_from_the_graph(pp):
    model = llama_meta()
    x = ids()
    plan = autoshard.plan(model, (2, 4), example_inputs=(x,), loss_fn=hf_lm_loss, example_target=x,
                          hardware="h100", layout=layouts.megatron(tp=2, pp=pp, recompute="full"))
    assert plan.mesh.shape == (4, 2)
    pls = plan.param_placements
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for name in pls:
        if any(f".{c}." in name for c in column) or name in ("lm_head.weight", "model.embed_tokens.weight"):
            want = (R, S0)
        elif ".o_proj." in name or ".down_proj." in name:
            want = (R, S1)
        else:
            want = (R, R)
        assert tuple(pls[name]) == want, name
    if pp == 1:
        assert plan.solution.levers.accumulation == BATCH // 4
    else:  # each stage on a (dp, tp) = (2, 2) submesh, microbatches of one sequence per dp rank
        assert [s.mesh.shape for s in plan.stages] == [(2, 2)] * 2 and plan.microbatches == BATCH // 2


def test_pipelined_megatron_pins_pp_schedule_microbatches_and_submesh():
    layout = layouts.megatron(tp=2, pp=2, virtual_stages=2, microbatch_size=1)
    plan = plan_gpt(layout, model=gpt_meta(layers=6))
    assert plan.pp == 2 and plan.virtual == 2
    assert plan.schedule == "interleaved-1f1b"  # the registry's name of v = 2
    assert plan.microbatches == BATCH // 2  # batch / (dp x microbatch size), dp = 8 / (tp x pp)
    assert [s.mesh.shape for s in plan.stages] == [(2, 2)] * 4
    assert f"layout: {layout.describe()}" in plan.summary()
    # the stage cut: 6 blocks over 4 stages, the two extra ones in the middle stages (the first also holds
    # the embedding, the last the head and loss), as Llama 3 split 126 layers over 32 stages
    blocks = [sorted({n.meta["autoshard.module"].split(".")[1] for n in (plan.captured.node(x) for x in s.nodes)
                      if str(n.meta.get("autoshard.module", "")).startswith("blocks.")}) for s in plan.stages]
    assert blocks == [["0"], ["1", "2"], ["3", "4"], ["5"]], blocks
    # every stage's placements are Megatron's on its (dp, tp) submesh, as without a pipeline
    assert set(plan.param_placements) >= {n for n, _ in gpt_meta(layers=6).named_parameters()}
    for name, pls in plan.param_placements.items():
        assert tuple(pls) == megatron_gpt_expected(name), name
    captured, stage_of = plan.captured, {n: s for s in plan.stages for n in s.nodes}
    for stage in plan.stages:
        for name in stage.nodes:
            if "layer_norm" in name:  # sequence parallel: each norm's output sequence-split over tp
                assert tuple(stage.solution.strategies[name].outputs[0]) == (S0, S1), name
            crosses = {stage_of[u.name].index for u in captured.node(name).users if u.name in stage_of}
            if crosses - {stage.index}:  # the residual stream is sent sequence-split, as Megatron sends it
                assert tuple(stage.solution.strategies[name].outputs[0]) == (S0, S1), name


def test_pipelined_fsdp_shards_over_dp_in_every_stage_and_megatron_replicates():
    """FSDP's storage is sharded over dp in every stage. Megatron computes with replicated parameters,
    its distributed optimizer included (ZeRO-1: ``test_megatron_distributed_optimizer_is_zero1_over_dp``)."""
    plan = plan_gpt(layouts.fsdp(tp=2, pp=2, checkpoint="full"), model=gpt_meta(layers=4))
    pls = plan.param_placements
    assert tuple(pls["blocks.3.q.weight"]) == (S1, S0)
    assert tuple(pls["blocks.1.o.weight"]) == (S0, S1)
    assert tuple(pls["blocks.2.ln1.weight"]) == (S0, R)
    plan = plan_gpt(layouts.megatron(tp=2, pp=2, recompute="none", distributed_optimizer=True),
                    model=gpt_meta(layers=4))
    for name, pls in plan.param_placements.items():
        assert tuple(pls) == megatron_gpt_expected(name), name


def test_bad_layouts_name_the_cause():
    with pytest.raises(LayoutError, match=r"tp=8 does not divide the 4 query heads"):
        plan_gpt(layouts.megatron(tp=8), mesh=8)
    with pytest.raises(LayoutError, match=r"tp\*cp\*pp\*dp = 2\*1\*1\*3 = 6 != mesh size 8"):
        plan_gpt(layouts.megatron(tp=2, dp=3), mesh=8)
    with pytest.raises(LayoutError, match=r"not a multiple of dp x microbatch_size = 4 x 4"):
        plan_gpt(layouts.megatron(tp=2, microbatch_size=4))
    with pytest.raises(LayoutError, match="recompute="):
        layouts.megatron(tp=2, recompute="some")
    with pytest.raises(LayoutError, match="pass virtual_stages= >= 2"):
        layouts.megatron(tp=2, pp=2, schedule="interleaved-1f1b")
    with pytest.raises(LayoutError, match=r"ep x etp = 3 x 2 = 6 does not divide the 8 ranks"):
        plan_gpt(layouts.megatron(tp=2, ep=3), mesh=8)
    with pytest.raises(TypeError, match="cannot be combined with layout="):
        x = ids()
        autoshard.plan(gpt_meta(), 8, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                       layout=layouts.fsdp(), checkpoint="full")


def test_layouts_round_trip_through_text_and_json():
    for layout in (layouts.megatron(tp=8, pp=16, virtual_stages=4, microbatch_size=1, distributed_optimizer=True),
                   layouts.megatron(tp=8, pp=35, scatter_gather_tensors_in_pipeline=False, blocking_p2p=True),
                   layouts.fsdp(tp=8, checkpoint="full", replicas=2)):
        assert layouts.parse(layout.describe()) == layout
        assert layouts.Layout.from_json(layout.to_json()) == layout
    assert layouts.parse("megatron:tp=8,pp=16") == layouts.megatron(tp=8, pp=16)
    with pytest.raises(LayoutError, match="start with one of"):
        layouts.parse("zero3:tp=2")
    with pytest.raises(LayoutError, match="takes"):
        layouts.parse("fsdp:tpp=2")


def test_pipelined_layout_checks_tp_against_the_heads_too():
    with pytest.raises(LayoutError, match=r"tp=8 does not divide the 4 query heads"):
        plan_gpt(layouts.megatron(tp=8, pp=2), mesh=16, model=gpt_meta(layers=4))


def test_summary_names_the_layout():
    layout = layouts.fsdp(checkpoint="full")
    text = plan_gpt(layout, mesh=8).summary()
    assert f"layout: {layout.describe()} (priced as given" in text.splitlines()[2]  # after the verdict and the header


def test_a_one_output_gate_stays_replicated_under_tensor_parallelism():
    """Qwen2-MoE's ``shared_expert_gate`` (hidden -> 1) cannot be split over tp = 2: it is kept
    replicated, as Megatron keeps such gates, while the attention and experts around it are split."""
    from autoshard.testing.hf_zoo import ZOO
    torch.manual_seed(0)
    model, inputs, target, loss_fn = ZOO["qwen2_moe"]()
    plan = autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="h100", layout=layouts.megatron(tp=2, recompute="none"))
    pls = plan.param_placements
    gates = [n for n in pls if n.endswith("shared_expert_gate.weight")]
    assert gates and all(tuple(pls[n]) == (R, R) for n in gates)
    assert tuple(pls["model.layers.0.self_attn.q_proj.weight"]) == (R, S0)
    assert tuple(pls["model.layers.0.self_attn.o_proj.weight"]) == (R, S1)


def test_sequence_parallelism_over_a_sequence_tp_does_not_divide_names_the_way_out():
    """ViT's 17 tokens (16 patches and the class token) do not split over tp = 2: the layout error
    says so and what to change; without sequence parallelism the same layout plans."""
    from autoshard.testing.hf_zoo import ZOO
    torch.manual_seed(0)
    model, inputs, target, loss_fn = ZOO["vit"]()
    kwargs = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="h100")
    with pytest.raises(LayoutError, match=r"sequence parallelism splits the sequence \(dim 1, length 17\).*"
                                          r"sequence_parallel=False"):
        autoshard.plan(model, (2, 2), layout=layouts.megatron(tp=2, recompute="none"), **kwargs)
    plan = autoshard.plan(model, (2, 2), layout=layouts.megatron(tp=2, recompute="none", sequence_parallel=False),
                          **kwargs)
    assert tuple(plan.param_placements["vit.layers.0.attention.q_proj.weight"]) == (R, S0)


@pytest.mark.parametrize("recompute, every_stage", [("full", True), ("none", False)])
def test_pipelined_layout_pins_its_recompute_on_every_stage(recompute, every_stage):
    """The stage planner recomputes whole stages: a pipelined layout's "full" / "none" pins that on
    every stage, so the layout is priced as it runs (GPT-3 175B's recompute="full" layout had been
    priced with recompute on 0 of 16 stages, the stage planner's own choice)."""
    plan = plan_gpt(layouts.megatron(tp=2, pp=2, recompute=recompute), model=gpt_meta(layers=4))
    assert plan.pp == 2
    assert [bool(s.recompute) for s in plan.stages] == [every_stage] * len(plan.stages)


def test_layout_stage_cut_splits_blocks_evenly_with_the_extra_ones_in_the_middle():
    """Megatron's cut: blocks split evenly; where the stages do not divide them, the first and last
    stages (which also hold the embedding and the head) get one fewer, as Llama 3's 126 layers on 32."""
    from autoshard.layout_plans import layout_stage_starts
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.layer_costs import layer_units
    x = ids()
    captured = capture(gpt_meta(layers=10), (x,), loss_fn=lm_loss, target=x)
    blocks = [i for i, u in enumerate(layer_units(captured)) if u.block is not None]

    def sizes(pp, v):
        starts = [blocks[0]] + layout_stage_starts(captured, layouts.megatron(tp=2, pp=pp, virtual_stages=v)) \
            + [blocks[-1] + 1]
        return [b - a for a, b in zip(starts, starts[1:])]
    assert sizes(2, 1) == [5, 5]
    assert sizes(2, 2) == [2, 3, 3, 2]
    assert sizes(3, 1) == [3, 4, 3]
    with pytest.raises(LayoutError, match="12 stages, but the model has 10 numbered blocks"):
        layout_stage_starts(captured, layouts.megatron(tp=2, pp=6, virtual_stages=2))


def test_context_parallel_inside_pipeline_stages():
    """cp > 1 with pp > 1 (refused before issue 28): each stage runs on a (cp, tp) submesh with its
    attention as ring attention over cp, the pipeline cutting the mesh's first axis."""
    plan = plan_gpt(layouts.megatron(cp=2, pp=2, recompute="none"), mesh=4, model=gpt_meta(layers=4))
    assert plan.pp == 2 and plan.mesh.axis_names == ("pp_cp", "tp")
    assert [s.mesh.shape for s in plan.stages] == [(2, 1)] * 2
    rings = [st for s in plan.stages for n, st in s.solution.strategies.items() if n.startswith("scaled_dot")]
    assert len(rings) == 4 and all(st.lowerings[0] == "ring_attention" and st.inputs[0][0] == Shard(2)
                                   for st in rings)


def test_uneven_pipeline_with_megatron_cores_options():
    """Megatron-Core's uneven pipeline: the embedding / the head counted as a block of the split (with
    blocks + 2 stages the first holds only the embedding and the last only the head, Llama 3 405B's
    layout), or the first / last rank's block counts given, the other stages sharing the rest."""
    from autoshard.layout_plans import layout_stage_starts, stage_block_counts
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.layer_costs import layer_units
    x = ids()
    captured = capture(gpt_meta(layers=10), (x,), loss_fn=lm_loss, target=x)
    units = layer_units(captured)
    blocks = [i for i, u in enumerate(units) if u.block is not None]
    head = len(units) - 1

    def blocks_per_stage(layout):
        starts = [0] + layout_stage_starts(captured, layout) + [len(units)]
        return [sum(1 for i in range(a, b) if i in blocks) for a, b in zip(starts, starts[1:])], starts
    counted = layouts.megatron(tp=2, pp=4, virtual_stages=3, account_for_embedding_in_pipeline_split=True,
                               account_for_loss_in_pipeline_split=True)
    per_stage, starts = blocks_per_stage(counted)
    assert per_stage == [0] + [1] * 10 + [0]
    assert starts[1] == blocks[0] and starts[-2] == head  # stage 0: the embedding alone; the last: the head alone
    per_stage, _ = blocks_per_stage(layouts.megatron(tp=2, pp=4, decoder_first_pipeline_num_layers=1,
                                                     decoder_last_pipeline_num_layers=1))
    assert per_stage == [1, 4, 4, 1]
    # rank 0's two blocks over its two virtual stages; the other 8 over the other four stages
    assert stage_block_counts(10, layouts.megatron(pp=3, virtual_stages=2, decoder_first_pipeline_num_layers=2)) \
        == [1, 2, 2, 1, 2, 2]
    assert stage_block_counts(128, layouts.megatron(pp=16, virtual_stages=8)) == [1] * 128  # 126 + embedding + head
    with pytest.raises(LayoutError, match="not both"):
        layouts.megatron(pp=4, decoder_first_pipeline_num_layers=2, account_for_embedding_in_pipeline_split=True)
    with pytest.raises(LayoutError, match="pass pp= > 1"):
        layouts.megatron(account_for_loss_in_pipeline_split=True)
    with pytest.raises(LayoutError, match="remaining"):
        layout_stage_starts(captured, layouts.megatron(tp=2, pp=2, decoder_first_pipeline_num_layers=11))
    with pytest.raises(LayoutError, match="14 stages"):
        layout_stage_starts(captured, layouts.megatron(tp=2, pp=2, virtual_stages=7, account_for_loss_in_pipeline_split=True))
    assert layouts.parse(counted.describe()) == counted


def test_megatron_without_sequence_parallel_all_reduces_and_runs_the_rest_whole_on_tp():
    """Megatron-LM without sequence parallelism (the 2021 runs): each row-parallel matmul (and the
    vocab-parallel embedding) outputs its partial sum over tp, and the op that reads it outputs the whole
    tensor on every tp rank (the all-reduce), so bias, dropout, residual and the next norm run whole."""
    from autoshard.passes.sharding.layout_placements import tensor_parallel_roles
    from autoshard.passes.spec import Partial
    plan = plan_gpt(layouts.megatron(tp=2, sequence_parallel=False, recompute="none"))
    roles = tensor_parallel_roles(plan.captured)
    assert roles.row and roles.vocab
    for name in (*roles.row, *roles.vocab):
        assert isinstance(tuple(plan.strategies[name].outputs[0])[1], Partial), name
        users = [u for u in plan.captured.node(name).users if u.op == "call_function"]
        assert all(tuple(plan.strategies[u.name].outputs[0])[1] == R for u in users), name


def test_megatron_2021s_gpt_is_split_as_megatron_split_it():
    """The literature's Megatron-LM 2021 GPT writes ``x @ w.t()`` and adds the fused QKV's bias by its own
    kernel (PyTorch 1.8's F.linear): both are found (column: query_key_value, dense_h_to_4h and the tied
    head; row: dense, dense_4h_to_h; the QKV and h-to-4h biases split with their features)."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    from megatron_gpt_2021 import lm_loss as loss, megatron_gpt
    x = ids()
    plan = autoshard.plan(megatron_gpt(2, 64, 4, SEQ, 256), (4, 2), example_inputs=(x,), loss_fn=loss, example_target=x,
                          hardware="a100", layout=layouts.megatron(tp=2, sequence_parallel=False, recompute="full"))
    pls = plan.param_placements
    for name in ("query_key_value", "mlp.dense_h_to_4h"):
        assert tuple(pls[f"layers.0.{'attention.' if 'query' in name else ''}{name}.weight"]) == (R, S0), pls
        assert tuple(pls[f"layers.0.{'attention.' if 'query' in name else ''}{name}.bias"]) == (R, S0), pls
    assert tuple(pls["layers.1.attention.dense.weight"]) == (R, S1) and tuple(pls["layers.1.mlp.dense_4h_to_h.weight"]) == (R, S1)
    assert tuple(pls["layers.1.attention.dense.bias"]) == (R, R) and tuple(pls["word_embeddings.weight"]) == (R, S0)


def test_megatrons_pipeline_runtime_prices_its_stage_boundaries_and_gradient_reduce():
    """Megatron's stage boundaries held whole on tp travel as 1/tp pieces, all-gathered by the receiver
    (scatter_gather_tensors_in_pipeline: cheaper than each tp rank sending the whole tensor over the
    network); its gradient all-reduces start after the backward unless overlap_grad_reduce; with
    blocking_p2p (DeepSpeed's pipeline engine) a stage also pays for its own sends."""
    import dataclasses
    from autoshard.passes.cost.hardware import PRESETS
    four_per_node = dataclasses.replace(PRESETS["a100"], name="a100-4-per-node", devices_per_node=4)

    def step(**kw):  # each rank group (dp 2 x tp 2) a node: the stage boundary crosses the network
        layout = layouts.megatron(tp=2, pp=2, sequence_parallel=False, recompute="none", **kw)
        x = torch.empty(64, 256, dtype=torch.long, device="meta")
        with torch.device("meta"):
            model = GPT(256, 1024, 4, 8, 256, tied=False)
        return autoshard.plan(model, (4, 2), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                              hardware=four_per_node, layout=layout).estimated_step_time
    default = step()
    assert step(scatter_gather_tensors_in_pipeline=False) > default
    assert step(overlap_grad_reduce=True) < default
    assert step(blocking_p2p=True) > default
