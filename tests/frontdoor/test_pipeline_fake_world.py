"""Any rank's program of a 1,024-GPU plan, built in this one process: GPT-3 175B's blocks on (128, 8) H100s.

The plan comes from ``autoshard.plan(..., pp=16)`` on a 16-block model of GPT-3 175B's width, sequence,
batch and vocabulary (meta device; the schedule and microbatch count are pinned to what the unpinned
planner picks for the whole 96-block model, ``benchmarks/plan_3d.py``, so the test does not search them):
the same world, stage submeshes ((32, 2)), tensor-parallel placements and ZeRO forms as the 96-block plan,
one block per stage, a third of its planning time (the subject is the fake world of many ranks, not the
depth; the 96-block plan also splits the boundary's sequence over the tensor-parallel axis, this one does
not). Then, for the first rank, one in the middle and the last, a fake
process group (``torch.testing``'s ``FakeStore`` / "fake" backend: collectives do nothing) of 1,024
ranks stands in for the world and ``driver.build_from_plan`` (what ``compile(..., plan=)``
runs on each rank) builds that rank's stages on the meta device. Each rank's program is checked
against the plan: its rank group and the members of each of its submesh communicators, the peers
it exchanges activations with and the shapes it exchanges, and the shape of every local parameter
shard (the full shape divided by the submesh axes its placement shards).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import autoshard
from autoshard.passes.capture.export import capture
from autoshard.passes.graph import META
from autoshard.passes.layout.shapes import local_shape, normalize
from autoshard.passes.sharding.storage_forms import form_of
from autoshard.passes.spec import Shard
from autoshard.driver import build_from_plan

transformers = pytest.importorskip("transformers")

MESH = (128, 8)
N_LAYER = 16  # one block per stage
BATCH, SEQ, D = 1536, 2048, 12288
PINS = dict(pp=16, schedule="zb-h1", microbatches=48)


def gpt3_175b_width():
    cfg = transformers.GPT2Config(n_layer=N_LAYER, n_embd=D, n_head=96, n_positions=SEQ, vocab_size=51200,
                                  attn_pdrop=0, resid_pdrop=0, embd_pdrop=0, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)


def lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@pytest.fixture(scope="module")
def planned():
    model = gpt3_175b_width()
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    target = ids.clone()
    plan = autoshard.plan(model, MESH, example_inputs=(ids,), loss_fn=lm_loss, example_target=target,
                          hardware="h100", time_limit_s=8, **PINS)
    m = plan.microbatches
    small = capture(model, (ids[:BATCH // m],), loss_fn=lm_loss, target=target[:BATCH // m])
    return model, ids, target, plan, small


def _expected_members(stage, rank: int, axes: tuple) -> list[int]:
    """The global ranks sharing ``rank``'s coordinates off ``axes`` on its stage's submesh."""
    mesh, ranks = stage.mesh, stage.ranks
    mine = mesh.coordinate(ranks.index(rank))
    return [r for i, r in enumerate(ranks)
            if all(c == m for a, (c, m) in enumerate(zip(mesh.coordinate(i), mine)) if a not in axes)]


@pytest.mark.slow  # plans a 1,024-rank world of GPT-3 175B-wide blocks
@pytest.mark.parametrize("rank", [0, 512, 1023])
def test_a_rank_of_the_175b_plan_builds_its_own_program(planned, rank):
    model, ids, target, plan, small = planned
    assert plan.pp == 16 and math.prod(plan.mesh.shape) == 1024
    assert len(plan.stages) == 16 and sum(len(s.nodes) for s in plan.stages) == \
        sum(1 for n in plan.captured.gm.graph.nodes if n.op == "call_function")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=1024)
    try:
        cm = build_from_plan(plan, model, example_inputs=(ids,), loss_fn=lm_loss, example_target=target,
                                   state_dict=model.state_dict(), device="meta", traces=(plan.captured, small))
        program = cm._program
        mine = [s for s in plan.stages if rank in s.ranks]
        assert [s.index for s in mine] == sorted(program.stages), "the rank builds exactly its group's stages"
        stage = mine[0]
        # its rank group, and the members of each of its submesh communicators
        env = program.env
        assert program.group == stage.group and env.ranks == stage.ranks
        assert env.mesh.shape == stage.mesh.shape and env.rank == stage.ranks.index(rank)
        for axis in range(stage.mesh.ndim):
            comm = env.comm(axis)
            want = _expected_members(stage, rank, (axis,))
            assert comm.size == len(want)
            if comm.size > 1:
                assert dist.get_process_group_ranks(comm.group) == want, f"axis {axis} of rank {rank}"
        # pipeline peers: the same position in the previous and the next stage's group, and what travels
        wiring, k = program.wiring, stage.ranks.index(rank)
        s = stage.index
        if s > 0:
            assert wiring.peer(k, s - 1) == plan.stages[s - 1].ranks[k]
            # each value arrives as the piece its producer's plan holds, the bytes the stage planner priced
            for v in wiring.receives[s]:
                name, producer = wiring.values[v]
                sender = cm.plan.stages[producer]
                placed = normalize(sender.solution.strategies[name].outputs[0], sender.mesh.shape)
                full = program.captured.node(name).meta[META].shape
                assert wiring.meta[v][0] == local_shape(full, placed, sender.mesh.shape), (name, placed)
            residual = [shape for shape, dtype in (wiring.meta[v] for v in wiring.receives[s])
                        if dtype == torch.bfloat16 and shape[-1] == D]
            assert residual and all(math.prod(x) < BATCH // plan.microbatches * SEQ * D for x in residual), residual
        else:
            assert wiring.receives[s] == []
        if s < len(plan.stages) - 1:
            assert wiring.peer(k, s + 1) == plan.stages[s + 1].ranks[k]
            assert any(s + 1 in consumers for _, consumers in wiring.sends[s])
        # every local shard the optimizer steps: the full shape cut by the submesh axes the plan shards
        # it on, and a ZeRO-1/2 parameter's slice cut again over its ZeRO axes
        local = dict(cm.named_parameters())
        assert set(local) == set(stage.solution.param_placements) - set(plan.captured.aliases)
        assert len(local) >= 4 * (N_LAYER // PINS["pp"]), "four weights per block at least"
        full = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        placeholder_of = {fqn: ph for ph, fqn in program.captured.params.items()}
        for fqn, tensor in local.items():
            assert tensor.is_meta
            want = list(full[fqn])
            for axis, pl in enumerate(stage.solution.param_placements[fqn]):
                if isinstance(pl, Shard):
                    want[pl.dim] //= stage.mesh.shape[axis]
            form = form_of(stage.solution.strategies[placeholder_of[fqn]], full[fqn], stage.mesh.shape)
            if form.zero:
                want[form.zero_dim] //= math.prod(stage.mesh.shape[a] for a in form.zero_axes)
            assert tuple(tensor.shape) == tuple(want), fqn
        assert any(tuple(t.shape) != full[n] for n, t in local.items()), "the plan shards some weight here"
    finally:
        dist.destroy_process_group()
