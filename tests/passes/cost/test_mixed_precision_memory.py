"""Mixed precision (FSDP2-style ``MixedPrecision``): the program is traced computing in
``param_dtype`` without touching the user's model, and the memory model counts fp32 masters, their
gradients and optimizer state, the compute copies, and gradient reduction at ``reduce_dtype``."""
import pytest
import torch

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import AutoshardError, TraceError
from autoshard.passes.levers import Levers, MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.solution import Solution, evaluate

from autoshard.testing import models

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_capture_with_param_dtype_traces_cast_copies_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.gpt()  # tied head / embedding
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    cg = capture(model, inputs, loss_fn=loss_fn, target=target, param_dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.dtype == torch.float32 and torch.equal(p, before[n][1])
    assert model.head.weight is model.wte.weight and cg.aliases == {"head.weight": "wte.weight"}
    metas = {n.name: n.meta["autoshard.meta"] for n in cg.gm.graph.nodes if n.op == "placeholder"}
    assert all(metas[ph].dtype == torch.bfloat16 for ph in cg.params)
    assert cg.master_dtypes == {ph: torch.float32 for ph in cg.params}
    # the program computes what the model computes with bf16 copies of its parameters
    copies = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    want = loss_fn(torch.func.functional_call(model, copies, inputs), target)
    got = cg.gm(*[copies[cg.params[ph]] for ph in cg.params], *model.buffers(), *inputs, target)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(TraceError, match="floating torch dtype"):
        capture(model, inputs, loss_fn=loss_fn, target=target, param_dtype=torch.int32)


@pytest.fixture(scope="module")
def gpt_fp32_meta():
    with torch.device("meta"):
        model = models.GPT(256, 128, 2, 4, 64, False)
    return model, torch.empty(8, 64, dtype=torch.long, device="meta")


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def test_masters_gradients_and_optimizer_state_keep_fp32_and_gradients_reduce_in_reduce_dtype(gpt_fp32_meta):
    """One data-parallel layout priced three ways: fp32, bf16 compute reducing in fp32, bf16 reducing in bf16."""
    model, ids = gpt_fp32_meta
    mesh = Mesh.of((4,))
    plain = capture(model, (ids,), loss_fn=models.lm_loss, target=ids)
    cast = capture(model, (ids,), loss_fn=models.lm_loss, target=ids, param_dtype=torch.bfloat16)
    dp = Pins(params={"*": ("R",)}, inputs={0: ("S(0)",)}, ops={"linear*": ("S(0)",)})
    fp32 = plan_sharding(plain, mesh, pins=dp)
    mp32 = evaluate(cast, mesh, fp32.strategies, levers=Levers(mixed_precision=BF16))
    mp16 = evaluate(cast, mesh, fp32.strategies, levers=Levers(mixed_precision=MixedPrecision(torch.bfloat16)))
    n = _numel(model)
    for sol in (mp32, mp16, fp32):
        assert sol.memory_breakdown["params"] == sol.memory_breakdown["grads"] == 4 * n  # replicated fp32
        assert sol.memory_breakdown["optimizer"] == 8 * n
    assert sum(c.bytes for syncs in mp32.param_grad_syncs.values() for c in syncs) == 4 * n
    assert sum(c.bytes for syncs in mp16.param_grad_syncs.values() for c in syncs) == 2 * n  # reduce in bf16
    assert mp16.time_breakdown["grad_sync"] < mp32.time_breakdown["grad_sync"]
    # bf16 activations are half of fp32's; the bf16 compute copies of the weights the matmuls keep
    # (every 2-D weight here but the embeddings, which an embedding lookup does not keep) are the
    # runtime gatherer's copies, cast without a collective: gathered weights, not activations
    copies = 2 * sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wte" not in name
                     and "wpe" not in name)
    assert mp32.memory_breakdown["activations"] == pytest.approx(fp32.memory_breakdown["activations"] / 2, rel=0.02)
    assert mp32.memory_breakdown["gathered_weights"] == pytest.approx(copies, rel=0.02)
    assert fp32.memory_breakdown["gathered_weights"] == 0  # replicated fp32 weights: no copy at all
    assert mp32.estimated_step_time < fp32.estimated_step_time  # matmuls at the bf16 peak


def test_plan_front_door_traces_in_param_dtype_and_the_plan_says_so(gpt_fp32_meta, tmp_path):
    model, ids = gpt_fp32_meta
    plan = autoshard.plan(model, (2,), example_inputs=(ids,), loss_fn=models.lm_loss, example_target=ids,
                          hardware="h100", mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                                                    reduce_dtype=torch.float32))
    assert plan.solution.levers.mixed_precision == BF16
    assert plan.solution.memory_breakdown["params"] >= 4 * _numel(model) / 2  # fp32 masters, at best halved
    plan.save(str(tmp_path / "p.json"))
    assert autoshard.load_plan(str(tmp_path / "p.json")).solution.levers.mixed_precision == BF16
    assert isinstance(Solution.from_json(plan.solution.to_json()), Solution)
    # a program captured in fp32 cannot be planned as computing in bf16
    cg = capture(model, (ids,), loss_fn=models.lm_loss, target=ids)
    with pytest.raises(AutoshardError, match=r"capture\(\.\.\., param_dtype=torch.bfloat16\)"):
        plan_captured(cg, (2,), hardware="h100", mixed_precision=BF16)
    with pytest.raises(AutoshardError, match="not supported"):
        autoshard.plan(model, (2,), example_inputs=(ids,), mixed_precision=autoshard.MixedPrecision(param_dtype="int8"))
