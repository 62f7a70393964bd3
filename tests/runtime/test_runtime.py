"""The runtime end to end: lowering, materialization, and training on 4 gloo ranks.

Graphs come from ``torch.export`` directly (``export_captured`` below) and plans are written by
hand (``st``), so these tests exercise the runtime alone. The distributed checks run in ONE spawn
of 4 ranks (``_rank_main``), which trains every scenario for 3 AdamW steps next to a single-device
copy and returns a list of mismatches per rank.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.graph import META, MODULE, CapturedGraph, tensor_meta_of
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy
from autoshard.runtime.executor import RankProgram
from autoshard.runtime.groups import MeshEnv, setup_distributed
from autoshard.runtime.layout import shard_tensor
from autoshard.runtime.lower import lower
from autoshard.runtime.materialize import materialize
from autoshard.testing.equivalence import Tolerance, adamw, tensor_mismatches, train_against_one_device
from autoshard.testing.models import MLP
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=1e-5)


# ---- building graphs and plans by hand -------------------------------------------------------

class _WithLoss(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.m, self.loss_fn = model, loss_fn

    def forward(self, x, target):
        return self.loss_fn(self.m(x), target)


def export_captured(model: nn.Module, x: torch.Tensor, target=None, loss_fn=None, *,
                    returns_loss: bool = False) -> CapturedGraph:
    """A CapturedGraph from torch.export: placeholders params, buffers, x[, target].

    ``loss_fn(model(x), target)`` is the loss; or ``returns_loss``: ``model(x, target)`` is."""
    root = _WithLoss(model, loss_fn) if loss_fn is not None else model
    with_target = loss_fn is not None or returns_loss
    ep = torch.export.export(root, (x, target) if with_target else (x,))
    sig, pre = ep.graph_signature, ("m." if loss_fn is not None else "")

    def strip(fqn: str) -> str:
        return fqn[len(pre):] if fqn.startswith(pre) else fqn

    canonical = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    every = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    canon = {n: canonical[id(t)] for n, t in every}
    aliases = {n: c for n, c in canon.items() if c != n}
    gm = ep.graph_module
    params = {p: canon[strip(f)] for p, f in sig.inputs_to_parameters.items()}
    first: dict = {}
    for node in list(gm.graph.nodes):  # tied weights: one placeholder per tensor
        if node.op == "placeholder" and node.name in params:
            keep = first.setdefault(params[node.name], node)
            if keep is not node:
                node.replace_all_uses_with(keep)
                gm.graph.erase_node(node)
                del params[node.name]
        node.meta[META] = tensor_meta_of(node.meta.get("val"))
        stack = node.meta.get("nn_module_stack")
        node.meta[MODULE] = strip(list(stack.values())[-1][0]) if stack else ""
    gm.recompile()
    user = list(sig.user_inputs)
    return CapturedGraph(gm, params, {b: canon[strip(f)] for b, f in sig.inputs_to_buffers.items()},
                         user[:1], user[1] if with_target else None, aliases, loss_output=with_target)


def _pl(tok: str):
    tok = tok.strip()
    return {"R": Replicate(), "P": Partial()}.get(tok) or Shard(int(tok[1:]))


def st(text: str, low=None) -> Strategy:
    """``st("S0|R, R|S0 -> S0|S1", low)``: operands split by ",", mesh axes by "|"; ``low``: a
    lowering name for every axis, or one entry per axis."""
    ins, outs = text.split("->")

    def parse(part):
        return tuple(tuple(_pl(t) for t in op.split("|")) for op in part.split(",") if op.strip())

    i, o = parse(ins), parse(outs)
    n = len((i + o)[0])
    return Strategy(i, o, tuple(low) if isinstance(low, (tuple, list)) else ((low,) * n if low else ()))


def by_fqn(cg: CapturedGraph, table: dict) -> dict:
    """Placeholder strategies from a table keyed by parameter/buffer FQN."""
    names = {**cg.params, **cg.buffers}
    return {ph: table[fqn] for ph, fqn in names.items()}


def mlp() -> MLP:
    """16 -> 32 -> 8 with a ReLU: the model every hand-written plan below is for."""
    return MLP(16, 32, 8, activation=F.relu)


def mlp_plans(cg: CapturedGraph) -> dict:
    """Hand-written DP, FSDP and Megatron TP plans on mesh (4,), and DP x TP on (2, 2)."""
    dp = by_fqn(cg, {n: st("-> R") for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")})
    dp |= {"x": st("-> S0"), "target": st("-> S0"), "linear": st("S0, R, R -> S0"), "relu": st("S0 -> S0"),
           "linear_1": st("S0, R, R -> S0"), "cross_entropy_loss": st("S0, S0 -> P", "loss_mean_partial")}
    fsdp = dp | by_fqn(cg, {n: st("-> S0") for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")})
    tp = by_fqn(cg, {"fc1.weight": st("-> S0"), "fc1.bias": st("-> S0"), "fc2.weight": st("-> S1"),
                     "fc2.bias": st("-> R")})
    tp |= {"x": st("-> R"), "target": st("-> R"), "linear": st("R, S0, S0 -> S1"), "relu": st("S1 -> S1"),
           "linear_1": st("S1, S1, P -> P"), "cross_entropy_loss": st("R, R -> R")}
    dptp = by_fqn(cg, {"fc1.weight": st("-> R|S0"), "fc1.bias": st("-> R|S0"), "fc2.weight": st("-> R|S1"),
                       "fc2.bias": st("-> R|R")})
    dptp |= {"x": st("-> S0|R"), "target": st("-> S0|R"), "linear": st("S0|R, R|S0, R|S0 -> S0|S1"),
             "relu": st("S0|S1 -> S0|S1"), "linear_1": st("S0|S1, R|S1, R|P -> S0|P"),
             "cross_entropy_loss": st("S0|R, S0|R -> P|R", ("loss_mean_partial", None))}
    return {"dp": ((4,), dp), "fsdp": ((4,), fsdp), "tp": ((4,), tp), "dptp": ((2, 2), dptp)}


def _data(step: int, batch=8, d=16, classes=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)


# ---- single-process tests ----------------------------------------------------------------------

EXPECTED_COUNTS = {
    "dp": {"chunk": 2, "all_reduce": 1, "grad_sync": 4, "grad_sync_buckets": 1},
    "fsdp": {"chunk": 2, "all_gather": 4, "all_reduce": 1},
    "tp": {"to_partial": 2, "all_reduce": 1, "grad_sync": 1, "grad_sync_buckets": 1},
    "dptp": {"chunk": 2, "to_partial": 2, "all_reduce": 2, "grad_sync": 4, "grad_sync_buckets": 2},
}


def test_emitted_programs_have_the_expected_collectives():
    torch.manual_seed(0)
    x, y = _data(0)
    cg = export_captured(mlp(), x, y, F.cross_entropy)
    for name, (mesh, plan) in mlp_plans(cg).items():
        env = MeshEnv.offline(Mesh(mesh), rank=1)
        rp = RankProgram.of_strategies(cg, plan, mesh, env=env, model=mlp())
        assert rp.collective_counts() == EXPECTED_COUNTS[name], name
        code = rp.program.code
        # parameter redistributions run inside one gather_params call per group (param_gather.py)
        param_kinds = {k for n in rp.program.graph.nodes for k in n.meta.get("autoshard.param_steps", ())}
        for kind in EXPECTED_COUNTS[name]:
            if not kind.startswith("grad_sync"):
                assert f"collectives_{kind}(" in code or (kind in param_kinds and "gather_params(" in code), \
                    (name, kind)
    tp = lower(cg, mlp_plans(cg)["tp"][1], MeshEnv.offline(Mesh((4,)), rank=2))
    lines = [ln.strip().split(" = ")[0] for ln in tp.code.splitlines() if "collectives_" in ln]
    assert lines == ["to_partial", "all_reduce", "to_partial_1"]


def test_bad_plans_and_batches_are_reported():
    x, y = _data(0, batch=6)
    cg = export_captured(mlp(), x, y, F.cross_entropy)
    plans = mlp_plans(cg)
    with pytest.raises(BatchError, match=r"input 'x' of shape \(6, 16\) is sharded on dim 0 over axis 0 \(4\) = 4 "
                                         r"ways, but 6 % 4 = 2"):
        lower(cg, plans["dp"][1], MeshEnv.offline(Mesh((4,))))
    x, y = _data(0)
    cg = export_captured(mlp(), x, y, F.cross_entropy)
    plans = mlp_plans(cg)
    partial = dict(plans["dp"][1])
    del partial["relu"]
    with pytest.raises(PlanFormatError, match="no strategy for node 'relu'"):
        lower(cg, partial, MeshEnv.offline(Mesh((4,))))
    bad = dict(plans["dp"][1], relu=st("S0|R -> S0|R"))
    with pytest.raises(PlanFormatError, match="placements for 2 axes"):
        lower(cg, bad, MeshEnv.offline(Mesh((4,))))


def test_step_alone_on_one_device_checks_inputs_and_matches_eager():
    torch.manual_seed(0)
    model = mlp()
    x, y = _data(0)
    cg = export_captured(model, x, y, F.cross_entropy)
    plan = by_fqn(cg, {n: st("-> R") for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")})
    plan |= {n: st("-> R") for n in ("x", "target")} | {
        n: st("R, R, R -> R") for n in ("linear", "linear_1")} | {"relu": st("R -> R"),
                                                                   "cross_entropy_loss": st("R, R -> R")}
    rp = RankProgram.of_strategies(cg, plan, (1,), env=setup_distributed(1), model=model)
    loss = rp.step(x, target=y)
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    for (name, p), (rname, rp_) in zip(rp.named_parameters(), model.named_parameters()):
        assert name == rname and torch.allclose(p.grad, rp_.grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(BatchError, match=r"traced with 1 input\(s\) \['x'\] but got 2"):
        rp.step(x, x, target=y)
    with pytest.raises(BatchError, match=r"input 'x' has shape \(4, 16\) but the program was traced with the "
                                         r"global batch \(8, 16\)"):
        rp.step(x[:4], target=y)
    with pytest.raises(BatchError, match="pass target="):
        rp.step(x)
    assert torch.allclose(rp.forward(x, target=y), ref.detach())


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w


class _Tied(nn.Module):
    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_materialize_slices_state_dicts_and_replays_meta_init():
    torch.manual_seed(3)
    cpu = _Tied()
    with torch.device("meta"):
        meta = _Tied()
    ids = torch.randint(0, 16, (4, 6))
    cg = export_captured(cpu, ids)
    assert cg.aliases == {"head.weight": "emb.weight"}
    layout = {"emb.weight": st("-> S0|S1"), "norm.weight": st("-> R|S0"), "norm.bias": st("-> P|R")}
    plan = by_fqn(cg, layout)
    full = cpu.state_dict()
    as_alias = {("head.weight" if k == "emb.weight" else k): v for k, v in full.items()}
    mesh = Mesh((2, 2))
    for rank in range(4):
        env = MeshEnv.offline(mesh, rank)
        from_model = materialize(cg, plan, env, model=cpu)
        from_sd = materialize(cg, plan, env, state_dict=as_alias)
        from_meta = materialize(cg, plan, env, model=meta, seed=3)
        for ph, fqn in cg.params.items():
            want = shard_tensor(full[fqn], plan[ph].outputs[0], mesh.shape, env.coordinate, partial="first")
            for got in (from_model[ph], from_sd[ph], from_meta[ph]):
                assert torch.equal(got, want), (rank, fqn)
            assert from_model[ph].untyped_storage().data_ptr() != full[fqn].untyped_storage().data_ptr()
    with torch.device("meta"):
        bad = _NoReset()
    cg_bad = export_captured(_NoReset(), torch.randn(2, 4))
    with pytest.raises(PlanFormatError, match=r"module '<root>' \(_NoReset\).*no reset_parameters"):
        materialize(cg_bad, by_fqn(cg_bad, {"w": st("-> R")}), MeshEnv.offline(Mesh((1,))), model=bad)
    with pytest.raises(PlanFormatError, match="no value for 'emb.weight'"):
        materialize(cg, plan, MeshEnv.offline(mesh), state_dict={})


# ---- training on 4 gloo ranks against a single-device copy --------------------------------------

class _BN(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before the norm: its true gradient is 0, and AdamW would amplify rounding noise there
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class _Vocab(nn.Module):
    """Tied embedding/head, class-weighted cross entropy with an ignore_index, loss inside."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.emb, self.norm = nn.Embedding(vocab, d), nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, vocab))

    def forward(self, x, target):
        logits = self.head(self.norm(self.emb(x)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               weight=self.class_weight, ignore_index=1)


class _Centered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8, bias=False)  # a bias would cancel out (zero gradient, see _BN)

    def forward(self, x):
        out = self.fc(x)
        return out - out.mean(0, keepdim=True)


def _bn_plan(cg):
    """(S0, S0): the batch split over both axes; batch-norm statistics synced over both."""
    both = ("batch_norm_sync", "batch_norm_sync")
    plan = by_fqn(cg, {n: st("-> R|R") for n in list(cg.params.values()) + list(cg.buffers.values())})
    plan |= {"x": st("-> S0|S0"), "target": st("-> S0|S0"), "linear": st("S0|S0, R|R -> S0|S0"),
             "add_": st("R|R -> R|R"), "relu": st("S0|S0 -> S0|S0"), "linear_1": st("S0|S0, R|R, R|R -> S0|S0"),
             "batch_norm": st("S0|S0, R|R, R|R, R|R, R|R -> S0|S0", both),
             "cross_entropy_loss": st("S0|S0, S0|S0 -> P|P", ("loss_mean_partial", "loss_mean_partial"))}
    return plan


def _bn_channels_plan(cg):
    """Channels split on (4,): each rank normalizes its channels; the replicated running stats are
    updated through a chunk, so the update is written back (all-gathered) into the stored copy."""
    plan = by_fqn(cg, {"fc1.weight": st("-> S0"), "bn.weight": st("-> S0"), "bn.bias": st("-> R"),
                       "fc2.weight": st("-> S1"), "fc2.bias": st("-> R"), "bn.running_mean": st("-> R"),
                       "bn.running_var": st("-> R"), "bn.num_batches_tracked": st("-> R")})
    plan |= {"x": st("-> R"), "target": st("-> R"), "linear": st("R, S0 -> S1"), "add_": st("R -> R"),
             "batch_norm": st("S1, S0, S0, S0, S0 -> S1"), "relu": st("S1 -> S1"),
             "linear_1": st("S1, S1, P -> P"), "cross_entropy_loss": st("R, R -> R")}
    return plan


def _vocab_plan(cg):
    """dp x tp: vocabulary-parallel embedding, vocabulary-sharded logits gathered for the loss."""
    plan = by_fqn(cg, {"emb.weight": st("-> R|S0"), "norm.weight": st("-> R|R"), "norm.bias": st("-> S0|R"),
                       "class_weight": st("-> R|R")})
    plan |= {"x": st("-> S0|R"), "target": st("-> S0|R"),
             "embedding": st("R|S0, S0|R -> S0|P", (None, "embedding_vocab")),
             "layer_norm": st("S0|R, R|R, R|R -> S0|R"), "linear": st("S0|R, R|S0 -> S0|S2"),
             "reshape": st("S0|S2 -> S0|S1"), "reshape_1": st("S0|R -> S0|R"),
             "cross_entropy_loss": st("S0|R, S0|R, R|R -> P|R", ("loss_mean_partial", None))}
    return plan


def _centered_plan(cg):
    plan = by_fqn(cg, {"fc.weight": st("-> S1")})
    plan |= {"x": st("-> S0"), "target": st("-> S0"), "linear": st("S0, R -> S0"),
             "mean": st("S0 -> P", "mean_partial"), "sub": st("S0, R -> S0"),
             "broadcast_tensors": st("S0, S0 -> S0, S0"), "getitem": st("S0 -> S0"), "getitem_1": st("S0 -> S0"),
             "mse_loss": st("S0, S0 -> P", "loss_mean_partial")}
    return plan


def _full_grads(rp: RankProgram) -> dict:
    from autoshard.runtime.redistribute import redistribute
    out = {}
    for (name, p), ph in zip(rp.named_parameters(), rp.captured.params):
        storage = rp.strategies[ph].outputs[0]
        as_grad = tuple(Replicate() if isinstance(q, Partial) else q for q in storage)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = redistribute(g, as_grad, (Replicate(),) * len(storage), rp.env)
    return out


def _train(bad: list, tag: str, env, cg, plan, model, ref, data, *, loss_fn=F.cross_entropy, reference_loss=None,
           rp_model=None, accumulate=False):
    """Train a ``RankProgram`` next to ``ref`` (3 AdamW steps); with ``accumulate``, also two more
    backward passes without zero_grad, comparing the accumulated full gradients."""
    rp = RankProgram.of_strategies(cg, plan, env.mesh, env=env, model=rp_model if rp_model is not None else model, seed=0)
    bad += train_against_one_device(tag, rp, ref, data, loss_fn=loss_fn, reference_loss=reference_loss, steps=3,
                                    tol=TOL, optimizer=adamw(lr=1e-2, eps=1e-8))
    if accumulate:  # two backward passes without zero_grad: gradients add up, each synced once
        for t in (10, 11):
            x, y = data(t)
            rp.step(x, target=y)
            loss_fn(ref(x), y).backward()
        bad += tensor_mismatches(f"{tag} accumulated grads", _full_grads(rp),
                                 {n: p.grad for n, p in ref.named_parameters()}, TOL)
    return rp


def _rank_main(rank: int, world: int) -> dict:
    bad: list = []
    envs = {(4,): setup_distributed(Mesh((4,))), (2, 2): setup_distributed(Mesh((2, 2)))}

    x0, y0 = _data(0)
    cg = export_captured(mlp(), x0, y0, F.cross_entropy)
    counts = {}
    for name, (mesh, plan) in mlp_plans(cg).items():
        torch.manual_seed(0)
        model = mlp()
        ref = copy.deepcopy(model)
        rp_model = None
        if name == "dptp":  # also: a meta-device model initialized by replay with the same seed
            with torch.device("meta"):
                rp_model = mlp()
        rp = _train(bad, name, envs[mesh], cg, plan, model, ref, _data, rp_model=rp_model,
                    accumulate=name in ("dptp", "fsdp"))
        counts[name] = rp.collective_counts()

    # forward-only program (no loss): outputs come back full
    cg_fwd = export_captured(mlp(), x0)
    tp = {k: v for k, v in mlp_plans(cg_fwd)["tp"][1].items() if k not in ("target", "cross_entropy_loss")}
    torch.manual_seed(1)
    model = mlp()
    rp = RankProgram.of_strategies(cg_fwd, tp, (4,), env=envs[(4,)], model=model)
    bad += tensor_mismatches("forward-only tp", {"out": rp.forward(x0)}, {"out": model(x0)}, TOL)

    torch.manual_seed(0)
    model = _BN()
    cg_bn = export_captured(model, x0, y0, F.cross_entropy)
    _train(bad, "batch_norm_sync (2,2)", envs[(2, 2)], cg_bn, _bn_plan(cg_bn), model, copy.deepcopy(model), _data)
    torch.manual_seed(0)
    model = _BN()
    _train(bad, "batch_norm channels (4,)", envs[(4,)], cg_bn, _bn_channels_plan(cg_bn), model, copy.deepcopy(model),
           _data)

    def tokens(step):
        g = torch.Generator().manual_seed(200 + step)
        ids, tgt = torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)
        tgt[0, :3] = 1  # ignored positions
        return ids, tgt

    torch.manual_seed(0)
    model = _Vocab()
    ids, tgt = tokens(0)
    cg_v = export_captured(model, ids, tgt, returns_loss=True)
    rp = _train(bad, "embedding_vocab (2,2)", envs[(2, 2)], cg_v, _vocab_plan(cg_v), model, copy.deepcopy(model),
                tokens, reference_loss=lambda m, inputs, y: m(*inputs, y))
    if "head.weight" not in rp.full_state_dict():
        bad.append("full_state_dict lacks the tied alias head.weight")
    counts["vocab"] = rp.collective_counts()

    torch.manual_seed(0)
    model = _Centered()
    cg_c = export_captured(model, x0, torch.randn(8, 8), F.mse_loss)
    regress = lambda step: (_data(step)[0], torch.randn(8, 8, generator=torch.Generator().manual_seed(step)))  # noqa
    _train(bad, "mean_partial (4,)", envs[(4,)], cg_c, _centered_plan(cg_c), model, copy.deepcopy(model),
           regress, loss_fn=F.mse_loss)
    return {"bad": bad, "counts": counts}


def test_training_on_4_ranks_matches_one_device():
    results = run_ranks(_rank_main, 4)
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}:\n" + "\n".join(res["bad"])
    counts = results[1]["counts"]
    for name, want in EXPECTED_COUNTS.items():
        assert counts[name] == want, name
    # vocab: all_reduce (embedding P -> R on tp, loss weight total on dp), all_gather (norm.bias on dp,
    # logits on tp),
    # chunk (ids, target on dp), to_partial (loss R -> P on tp)
    assert counts["vocab"] == {"chunk": 2, "all_reduce": 2, "all_gather": 2, "to_partial": 1,
                               "grad_sync": 3, "grad_sync_buckets": 3}
