"""Checkpoints: ``cm.state_dict()`` / ``optimizer_state_dict`` through ``torch.distributed.checkpoint``.

On 4 gloo ranks: a model whose fused QKV weight a state-dict hook saves as separate q/k/v tensors (and
a load pre-hook fuses back) trains under data parallel on (4,), saves, and a fresh model under tensor
parallel on (2, 2) loads it (resharding) with pickle and ``torch.load`` disabled; the loaded weights
equal the saved ones bit for bit and the next step matches. The same with stock ``dcp.save`` /
``dcp.load``, as torchtitan calls them. A 2-stage pipeline with a tied embedding saves and a plain
(2, 2) program loads it, and back. In one process: the names are exactly ``model.state_dict()``'s,
values that would need pickle are refused, mismatched state dicts name their keys.
"""
from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.ranks import run_ranks

RTOL, ATOL = 1e-4, 1e-6


def _split_qkv(module, state_dict, prefix, local_metadata):
    fused = state_dict.pop(prefix + "qkv.weight")
    for name, part in zip("qkv", fused.chunk(3, 0)):
        state_dict[prefix + name + ".weight"] = part


def _fuse_qkv(state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    names = [prefix + n + ".weight" for n in "qkv"]
    if all(n in state_dict for n in names):
        state_dict[prefix + "qkv.weight"] = torch.cat([state_dict.pop(n) for n in names])


class FusedQKV(nn.Module):
    """A fused q/k/v projection saved, as checkpoints of unfused models expect, as q, k and v."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(3 * d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self._register_state_dict_hook(_split_qkv)
        self._register_load_state_dict_pre_hook(_fuse_qkv)

    def forward(self, x):
        return self.o(F.gelu(self.qkv(x))) * self.scale


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


class _NoUnpickling:
    """Within the block, any unpickling or ``torch.load`` raises."""

    def __enter__(self):
        def refuse(*args, **kwargs):
            raise AssertionError("a checkpoint load unpickled something")
        self.saved = (pickle.load, pickle.loads, torch.load)
        pickle.load = pickle.loads = torch.load = refuse

    def __exit__(self, *exc):
        pickle.load, pickle.loads, torch.load = self.saved


def reshard_worker(rank: int, world: int, root: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import autoshard
    from autoshard import checkpoint, presets
    failures = []
    x, y = _data()
    torch.manual_seed(0)
    model = FusedQKV()
    ref = copy.deepcopy(model)
    cm = autoshard.compile(model, (4,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="cpu",
                           **presets.data_parallel((4,)))
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        cm.step(x, target=y); opt.step(); opt.zero_grad()
        F.mse_loss(ref(x), y).backward(); ref_opt.step(); ref_opt.zero_grad()
    sd = cm.state_dict()
    if list(sd) != list(ref.state_dict()):
        failures.append(f"state_dict names {list(sd)}, model.state_dict() has {list(ref.state_dict())}")
    if not all(isinstance(v, DTensor) for v in sd.values()):
        failures.append("state_dict values are not all DTensors")
    if tuple(sd["o.weight"].placements) != tuple(cm.plan.param_placements["o.weight"]):
        failures.append(f"o.weight placed {sd['o.weight'].placements}, the plan says {cm.plan.param_placements['o.weight']}")
    saved = cm.full_state_dict()
    for key, value in ref.state_dict().items():
        if not torch.allclose(saved[key], value, rtol=RTOL, atol=ATOL):
            failures.append(f"full_state_dict[{key!r}] differs from one device")
    checkpoint.save({"model": sd, "optim": cm.optimizer_state_dict(opt), "step": 2}, f"{root}/json")
    dcp.save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt)}, checkpoint_id=f"{root}/dcp")

    tp = {"params": {"qkv.weight": ("R", "S(0)"), "o.weight": ("R", "S(1)")}, "inputs": {0: ("S(0)", "R")}}
    want_loss = F.mse_loss(ref(x), y).item()
    for fmt in ("json", "dcp"):
        torch.manual_seed(1)  # other initial values: the load must overwrite them all
        other = autoshard.compile(FusedQKV(), (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                                  hardware="cpu", **tp)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        state = {"model": other.state_dict(), "optim": other.optimizer_state_dict(other_opt)}
        if fmt == "json":
            state["step"] = 0
            with _NoUnpickling():
                checkpoint.load(state, f"{root}/json")
            if state["step"] != 2:
                failures.append(f"the step count came back as {state['step']!r}")
        else:
            dcp.load(state, checkpoint_id=f"{root}/dcp")
        other.load_state_dict(state["model"])
        other.load_optimizer_state_dict(other_opt, state["optim"])
        loaded = other.full_state_dict()
        for key in saved:
            if not torch.equal(saved[key], loaded[key]):
                failures.append(f"{fmt}: {key} after the load differs from what was saved")
        got = other.step(x, target=y)
        if abs(got - want_loss) > 1e-5 * abs(want_loss):
            failures.append(f"{fmt}: the loss after loading is {got}, one device {want_loss}")
        other_opt.step()
        if fmt == "json":  # the optimizer state came back too: the next update equals one device's
            F.mse_loss(ref(x), y).backward(); ref_opt.step()
            after = other.full_state_dict()
            for key, value in ref.state_dict().items():
                if not torch.allclose(after[key], value, rtol=RTOL, atol=ATOL):
                    failures.append(f"{fmt}: {key} after a step from the loaded state differs from one device")
    return failures


def test_checkpoint_saved_under_data_parallel_loads_under_tensor_parallel(tmp_path):
    failures = run_ranks(reshard_worker, 4, str(tmp_path), timeout=300)
    assert failures == [[]] * 4, failures
    assert os.path.exists(tmp_path / "json" / ".metadata.json") and not os.path.exists(tmp_path / "json" / ".metadata")


def pipeline_worker(rank: int, world: int, root: str) -> list:
    import autoshard
    from autoshard import checkpoint
    from autoshard.testing.models import gpt_pipeline
    failures = []
    torch.manual_seed(0)
    model, inputs, target, loss_fn, _ = gpt_pipeline(n_layer=2)
    common = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
    piped = autoshard.compile(model, (4,), pp=2, schedule="1f1b", microbatches=2, time_limit_s=5, **common)
    if not piped.plan.pipelined:
        return ["premise: compile(pp=2) built no pipeline"]
    opt = torch.optim.AdamW(piped.parameters(), lr=1e-2)
    for _ in range(2):
        piped.step(*inputs, target=target); opt.step(); opt.zero_grad()
    saved = piped.full_state_dict()
    if list(saved) != list(model.state_dict()):
        failures.append(f"pipeline full_state_dict names {list(saved)} are not model.state_dict()'s")
    checkpoint.save({"model": piped.state_dict(), "optim": piped.optimizer_state_dict(opt)}, f"{root}/pp")

    torch.manual_seed(1)
    fresh, *_ = gpt_pipeline(n_layer=2)
    plain = autoshard.compile(fresh, (2, 2), **common)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    state = {"model": plain.state_dict(), "optim": plain.optimizer_state_dict(plain_opt)}
    checkpoint.load(state, f"{root}/pp")
    plain.load_state_dict(state["model"])
    plain.load_optimizer_state_dict(plain_opt, state["optim"])
    loaded = plain.full_state_dict()
    failures += [f"pipeline -> plain: {k} differs" for k in saved if not torch.equal(saved[k], loaded[k])]
    a, b = piped.step(*inputs, target=target), plain.step(*inputs, target=target)
    if abs(a - b) > 1e-5 * abs(a):
        failures.append(f"pipeline -> plain: next losses {a} and {b}")
    opt.step(); opt.zero_grad(); plain_opt.step(); plain_opt.zero_grad()

    checkpoint.save({"model": plain.state_dict(), "optim": plain.optimizer_state_dict(plain_opt)}, f"{root}/plain")
    torch.manual_seed(2)
    fresh, *_ = gpt_pipeline(n_layer=2)
    piped2 = autoshard.compile(fresh, (4,), pp=2, schedule="1f1b", microbatches=2, time_limit_s=5, **common)
    opt2 = torch.optim.AdamW(piped2.parameters(), lr=1e-2)
    state = {"model": piped2.state_dict(), "optim": piped2.optimizer_state_dict(opt2)}
    checkpoint.load(state, f"{root}/plain")
    piped2.load_state_dict(state["model"])
    piped2.load_optimizer_state_dict(opt2, state["optim"])
    want, got = plain.full_state_dict(), piped2.full_state_dict()
    failures += [f"plain -> pipeline: {k} differs" for k in want if not torch.equal(want[k], got[k])]
    for _ in range(2):  # the tied copies and their optimizer state came back equal: training continues alike
        a, b = plain.step(*inputs, target=target), piped2.step(*inputs, target=target)
        plain_opt.step(); plain_opt.zero_grad(); opt2.step(); opt2.zero_grad()
        if abs(a - b) > 1e-5 * abs(a):
            failures.append(f"plain -> pipeline: losses {a} and {b}")
    return failures


def test_pipeline_checkpoint_loads_without_a_pipeline_and_back(tmp_path):
    failures = run_ranks(pipeline_worker, 4, str(tmp_path), timeout=400)
    assert failures == [[]] * 4, failures


# ---- one process ------------------------------------------------------------------------------------

def _alone():
    import autoshard
    x, y = _data()
    torch.manual_seed(0)
    model = FusedQKV()
    return model, autoshard.compile(model, 1, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                                    hardware="cpu"), x, y


def test_state_dicts_use_the_names_state_dict_hooks_give():
    model, cm, x, y = _alone()
    assert list(cm.state_dict()) == list(model.state_dict()) == ["scale", "o.weight", "o.bias", "q.weight",
                                                                  "k.weight", "v.weight"]
    full = cm.full_state_dict()
    assert list(full) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(full[key], value), key


def test_load_runs_no_pickle_and_restores_every_value(tmp_path):
    from autoshard import checkpoint
    model, cm, x, y = _alone()
    opt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    cm.step(x, target=y); opt.step(); opt.zero_grad()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    checkpoint.save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt), "sched": sched.state_dict(),
                     "meta": {"step": 1, "betas": (0.9, 0.95), "rng": torch.get_rng_state()}}, tmp_path)
    with open(tmp_path / ".metadata.json") as f:
        json.load(f)
    _, other, _, _ = _alone()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1.0)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=3, gamma=0.5)
    state = {"model": other.state_dict(), "optim": other.optimizer_state_dict(other_opt),
             "sched": other_sched.state_dict(), "meta": {"step": 0, "betas": None, "rng": torch.zeros(5056, dtype=torch.uint8)}}
    with _NoUnpickling():
        checkpoint.load(state, tmp_path)
    other.load_state_dict(state["model"])
    other.load_optimizer_state_dict(other_opt, state["optim"])
    other_sched.load_state_dict(state["sched"])
    assert state["meta"]["step"] == 1 and state["meta"]["betas"] == (0.9, 0.95)
    assert torch.equal(state["meta"]["rng"], torch.get_rng_state())
    for key, value in cm.full_state_dict().items():
        assert torch.equal(other.full_state_dict()[key], value), key
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(cm.parameters(), other.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], other_opt.state[q][k]), k


def test_a_value_that_needs_pickle_is_refused_at_save(tmp_path):
    from autoshard import CheckpointError, checkpoint
    with pytest.raises(CheckpointError, match=r"\['train'\]\['schedule'\].*function"):
        checkpoint.save({"train": {"schedule": lambda step: 1.0}}, tmp_path)


def test_a_mismatched_state_dict_names_its_keys():
    from autoshard import CheckpointError
    model, cm, x, y = _alone()
    sd = cm.state_dict()
    del sd["k.weight"]
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"missing \['k.weight'\], unexpected \['extra.weight'\]"):
        cm.load_state_dict(sd)


def test_full_tensors_load_into_the_shards():
    model, cm, x, y = _alone()
    fresh = FusedQKV()
    cm.load_state_dict(fresh.state_dict())
    for key, value in fresh.state_dict().items():
        assert torch.equal(cm.full_state_dict()[key], value), key


def test_json_values_round_trip():
    from autoshard.runtime.checkpoint_files import decode_value, encode_value
    value = {"a": (1, 2.5, None), "b": [True, "x", {"__tuple__": 3}], "c": {"d": (("e",),)}}
    assert decode_value(json.loads(json.dumps(encode_value(value)))) == value


class WithSpare(nn.Module):
    """Four blocks and a head no op reads: a pipeline stage holds no copy of ``spare``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.spare = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = F.gelu(block(x))
        return x


def unread_worker(rank: int, world: int, root: str) -> list:
    import autoshard
    from autoshard import checkpoint
    x, y = _data()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = WithSpare()
    piped = autoshard.compile(model, (4,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="cpu",
                              pp=2, schedule="1f1b", microbatches=2, stages=["blocks.2"], time_limit_s=5)
    torch.manual_seed(0)
    want = WithSpare().state_dict()  # the same seed on a real device: the values a meta model replays
    full = piped.full_state_dict()
    failures = [] if list(full) == list(want) else [f"names {list(full)}, model.state_dict() has {list(want)}"]
    failures += [f"{k} differs from the model's" for k in want if k in full and not torch.equal(full[k], want[k])]
    checkpoint.save({"model": piped.state_dict()}, root)
    torch.manual_seed(5)
    plain = autoshard.compile(WithSpare(), (4,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                              hardware="cpu")
    state = {"model": plain.state_dict()}
    checkpoint.load(state, root)
    plain.load_state_dict(state["model"])
    loaded = plain.full_state_dict()
    failures += [f"{k} was not restored" for k in want if not torch.equal(loaded[k], want[k])]
    return failures


def test_a_parameter_no_pipeline_stage_reads_is_saved_too(tmp_path):
    failures = run_ranks(unread_worker, 4, str(tmp_path / "ck"), timeout=300)
    assert failures == [[]] * 4, failures


def mismatch_worker(rank: int, world: int) -> str:
    import autoshard
    x, y = _data()
    torch.manual_seed(0)
    cm = autoshard.compile(FusedQKV(), (2,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y, hardware="cpu")
    sd = cm.state_dict()
    if rank == 1:
        del sd["o.bias"]
    try:
        cm.load_state_dict(sd)
    except autoshard.CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_state_dict_wrong_on_one_rank_stops_every_rank():
    messages = run_ranks(mismatch_worker, 2, timeout=60)
    assert "another rank's state dict does not match" in messages[0]
    assert "missing ['o.bias']" in messages[1]
