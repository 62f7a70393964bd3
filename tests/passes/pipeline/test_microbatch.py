"""Plans made on the global batch but run on pipeline microbatches: strategies that would split a
microbatch's batch dimension unevenly are kept out of the ILP, and a plan reports the smallest
microbatch it stays valid for. One process, meta-device models."""
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.graph import operand_meta, operands, outputs
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.pipeline.stages.candidate_plan import plan_submesh
from autoshard.passes.solve.microbatch import (batch_dependent, batch_granularity, global_batch,
                                                  microbatch_strategies)
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.spec import Shard
from autoshard.passes.sharding.strategies import enumerate_strategies
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.pipeline.stages.candidate_plan import CandidateSpec
from autoshard.passes.solve.context import PlanContext

BATCH, SEQ = 8, 16


def _captured(vocab=64, d=32, seq=SEQ):
    with torch.device("meta"):
        model = GPT(vocab, d, 2, 4, seq, False)
    ids = torch.empty(BATCH, seq, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


def _dim0_ways(pls, mesh):
    n = 1
    for a, p in enumerate(pls):
        if isinstance(p, Shard) and p.dim == 0:
            n *= mesh.shape[a]
    return n


def test_microbatch_of_one_sequence_keeps_sequence_splits_and_drops_batch_splits():
    captured = _captured()
    mesh = Mesh((4,))
    table = enumerate_strategies(captured, mesh)
    allowed = microbatch_strategies(captured, table, mesh, microbatches=BATCH)  # one sequence each
    ids = captured.inputs[0]
    assert any(_dim0_ways(s.outputs[0], mesh) == 4 for s in table[ids])  # the global batch splits 4 ways ...
    assert all(_dim0_ways(table[ids][k].outputs[0], mesh) == 1 for k in allowed[ids])  # ... one sequence cannot
    # the loss reads the logits flattened to [batch * seq, vocab]: 16 token rows per sequence still split
    # 4 ways (the reshape producing them cannot split its one-sequence input, the loss can split its rows)
    batch = batch_dependent(captured)
    loss = [n for n in captured.gm.graph.nodes if n.op == "call_function" and n.name in batch
            and all(operand_meta(op).shape[:1] == (BATCH * SEQ,) for op in operands(n))]
    assert loss
    for node in loss:
        kept = allowed.get(node.name, set(range(len(table[node.name]))))
        assert any(_dim0_ways(table[node.name][k].inputs[0], mesh) == 4 for k in kept), node.name
    assert microbatch_strategies(captured, table, mesh, microbatches=2) == {}  # 4 sequences split 4 ways: all fine


def test_plans_for_a_microbatch_are_valid_at_it_and_report_their_granularity():
    # big enough that, priced per microbatch, splitting the GLOBAL batch 4 ways would be the cheapest plan
    captured = _captured(vocab=512, d=512, seq=128)
    assert global_batch(captured) == BATCH
    batch = batch_dependent(captured)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    for m in (BATCH, 2):
        sol = plan_submesh(captured, Mesh((4, 1)),
                           PlanContext.of(PRESETS["h100"], memory_limit=1e12, optimizer="adamw", time_limit_s=10),
                           CandidateSpec(microbatches=m, held=1))
        rows = BATCH // m
        for name, s in sol.strategies.items():
            if name in batch:
                for meta, pls in zip(outputs(nodes[name]), s.outputs):
                    if meta is not None and meta.shape and meta.shape[0] % BATCH == 0:
                        assert (meta.shape[0] // m) % _dim0_ways(pls, sol.mesh) == 0, (m, name, s)
        grain = batch_granularity(captured, sol)
        assert rows % grain == 0
    # plain data parallel over 4 splits the sequences themselves: microbatches of a multiple of 4
    dp = plan_sharding(captured, Mesh((4,)), pins=Pins(params={"*": ("R",)}, inputs={0: ("S(0)",)}))
    assert batch_granularity(captured, dp) == 4


def test_a_mask_broadcast_to_the_batch_follows_the_batch():
    """HF's causal mask is built from positions and expanded to the input's batch size: traced at a
    microbatch it has the microbatch's rows, so a pipeline cut carries one microbatch's mask, not the
    global batch's (Llama 3 405B: a 1 GiB mask per device crossed every cut, 4x its hidden state)."""
    from autoshard.passes.pipeline.stages.layer_costs import profile_submesh
    from autoshard.testing.hf_zoo import ZOO
    torch.manual_seed(0)
    model, inputs, target, loss_fn = ZOO["llama"]()
    ids = torch.randint(0, 96, (8, 64))  # 64 positions: the (8, 1, 64, 64) mask outweighs the rotary tables
    captured = capture(model, {"input_ids": ids}, loss_fn=loss_fn, target=ids.clone())
    batch = global_batch(captured)
    meta = lambda n: n.meta.get("autoshard.meta")  # noqa: E731
    calls = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    broadcasts = [n for n in calls if n.target is torch.ops.aten.expand.default and meta(n.args[0]).shape[0] == 1
                  and meta(n).shape[0] == batch > 1]
    masks = [n for n in calls if getattr(meta(n), "dtype", None) == torch.bool and tuple(meta(n).shape) == (batch, 1, 64, 64)]
    assert broadcasts and masks, "premise: the traced Llama expands positions to the batch and builds its mask from them"
    found = batch_dependent(captured)
    assert all(n.name in found for n in broadcasts + masks)
    profile = profile_submesh(captured, plan_sharding(captured, (1,), PlanContext.of("cpu")), PlanContext.of("cpu"))
    mask_bytes = meta(masks[-1]).nbytes
    assert profile.cut_batch[1] >= mask_bytes  # the cut after the first block carries it, per microbatch
    assert all(fixed < mask_bytes for fixed in profile.cut_fixed), profile.cut_fixed


def test_a_mask_repeated_to_the_batch_follows_the_batch():
    """A mask built without the input and repeated (not expanded) to the batch follows it too, and so
    does what is computed from it; the mask it was repeated from does not."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            base = torch.ones(1, x.shape[1], x.shape[1]).tril()
            mask = base.repeat(x.shape[0], 1, 1)
            return self.lin(torch.bmm(mask, x))

    x = torch.randn(8, 12, 16)
    captured = capture(Masked(), (x,), loss_fn=torch.nn.functional.mse_loss, target=torch.randn(8, 12, 16))
    calls = {n.name: n for n in captured.gm.graph.nodes if n.op == "call_function"}
    repeats = [n for n in calls.values() if n.target is torch.ops.aten.repeat.default]
    assert repeats, "premise: the traced program repeats the mask to the batch"
    found = batch_dependent(captured)
    assert all(n.name in found for n in repeats)
    assert all(n.args[0].name not in found for n in repeats)  # the one-row mask stays fixed
    bmm = [n for n in calls.values() if n.target is torch.ops.aten.bmm.default]
    assert bmm and all(n.name in found for n in bmm)
