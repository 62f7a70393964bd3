"""Elastic training (``autoshard.elastic``): lose a node, get it back, and train on exactly as before.

The multi-node test runs ``examples/train_elastic.py`` as one elastic torchrun job of two agents on
loopback (``--nnodes=1:2 --nproc-per-node=2``, c10d rendezvous, ``--max-restarts``), each agent a
"node" of 2 ranks, and drives it through 2 -> 4 -> 2 ranks, every change triggered by a checkpoint
on disk (the ``LATEST`` pointer and the world it records), never by elapsed time:

1. agent A alone trains on world 2;
2. once world 2 has checkpointed, agent B joins: torchrun restarts A's ranks and both agents' ranks
   rendezvous as world 4 (the way back, live), which plan a (2, 2) mesh and reshard;
3. once world 4 has checkpointed, agent B's process group and its ranks are SIGKILLed: A's ranks fail,
   torchrun restarts them on world 2, which loads world 2's cached plan, reshards and finishes.

The loss of every step (the last run of each) and the final parameters equal an unbroken run's (the
same example alone, world 1) within float tolerance. The single-process tests cover the error cases.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import autoshard
from autoshard.runtime.checkpoint_files import METADATA_FILE, load
from autoshard.runtime.checkpoint_pointer import checkpoint_info
from autoshard.testing.ranks import free_port

EXAMPLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_elastic.py"))
STEPS, EVERY = 40, 4
#: torch 2.13's c10d rendezvous shares one TCPStore across rounds; an agent that stays rank 0 into a
#: later round (here A when B joins) then never publishes that round's MASTER_ADDR, and the joining
#: agent times out waiting for it. Each round building its own store info avoids that.
RDZV_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
#: AdamW eps 1e-6, not 1e-8: attention's key bias has an analytically zero gradient (softmax ignores a
#: constant added to every score), so what reaches it is rounding noise, which differs with the world
#: size's summation order; with eps 1e-8 Adam normalizes that noise into steps of the learning rate's
#: size (seen: 4e-5 apart after 40 steps, every other parameter within 1.2e-7).
ARGS = ["--steps", str(STEPS), "--every", str(EVERY), "--width", "32", "--seq", "16", "--batch", "8",
        "--adam-eps", "1e-6"]


def _example(cwd, ckpt: str, log: str, *extra: str, timeout: float = 300) -> str:
    """The example alone (world 1); returns its output."""
    done = subprocess.run([sys.executable, EXAMPLE, "--checkpoint-dir", ckpt, "--loss-log", log, *ARGS, *extra],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def _agent(cwd, port: int, is_host: bool, out_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "autoshard-elastic",
           "--rdzv-conf", f"is_host={int(is_host)},join_timeout=240,last_call_timeout=3",
           "--max-restarts", "3", "--monitor-interval", "0.2", EXAMPLE, "--checkpoint-dir", "ck",
           "--loss-log", "broken.jsonl", "--step-sleep", "0.25", "--collective-timeout", "60", *ARGS]
    return subprocess.Popen(cmd, cwd=cwd, stdout=open(out_path, "w"), stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", **RDZV_ENV}, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                todo += kids
        except OSError:
            pass
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and every descendant's (torchrun starts each rank in a session
    of its own): a whole node lost at once."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


def _wait_for(what, condition, procs, deadline: float, outs) -> None:
    while not condition():
        for p, out in zip(procs, outs):
            assert p.poll() is None, f"premise: still running while waiting for {what}:\n{open(out).read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _pointer_world(ckpt) -> int | None:
    try:
        info = checkpoint_info(str(ckpt))
    except Exception:  # noqa: BLE001 - a pointer being replaced right now reads next time
        return None
    return None if info is None else info.get("world")


def _losses(path) -> dict:
    """step -> loss of the last run of each step (steps after a checkpoint may run twice)."""
    out = {}
    with open(path) as f:
        for d in map(json.loads, f):
            out[d["step"]] = (float.fromhex(d["loss"]), d["world"])
    return out


def _final_params(ckpt) -> dict:
    info = checkpoint_info(str(ckpt))
    with open(os.path.join(info["path"], METADATA_FILE)) as f:
        tensors = json.load(f)["tensors"]
    model = {k[len("model."):]: torch.empty(t["size"], dtype=getattr(torch, t["dtype"]))
             for k, t in tensors.items() if k.startswith("model.")}
    state = {"model": model}
    load(state, info["path"])
    return state["model"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's ranks through /proc")
def test_lose_a_node_and_get_it_back_trains_as_an_unbroken_run(tmp_path):
    # the unbroken run (world 1, its own folder) goes beside the elastic job, which mostly sleeps between steps
    unbroken = subprocess.Popen([sys.executable, EXAMPLE, "--checkpoint-dir", "ck_unbroken", "--loss-log",
                                 "unbroken.jsonl", *ARGS], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "unbroken.txt", "w"))
    port, ck = free_port(), tmp_path / "ck"
    outs = [tmp_path / "agent_a.txt", tmp_path / "agent_b.txt"]
    a = b = None
    try:
        a = _agent(tmp_path, port, True, outs[0])
        deadline = time.monotonic() + 400
        _wait_for("a checkpoint of world 2", lambda: _pointer_world(ck) == 2, [a], deadline, outs[:1])
        b = _agent(tmp_path, port, False, outs[1])
        _wait_for("a checkpoint of world 4", lambda: _pointer_world(ck) == 4, [a, b], deadline, outs)
        _kill_tree(b)
        a.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                _kill_tree(p)
        if unbroken.poll() is None and (a is None or a.returncode != 0):
            unbroken.kill()  # the test fails on the elastic job: nothing waits for this run
    out_a = outs[0].read_text()
    assert a.returncode == 0, out_a[-4000:]
    assert unbroken.wait(timeout=300) == 0, (tmp_path / "unbroken.txt").read_text()[-3000:]
    want = _losses(tmp_path / "unbroken.jsonl")
    assert sorted(want) == list(range(STEPS))

    starts = [json.loads(line) for line in open(ck / "elastic_log.jsonl")]
    changes = [(s["old_world"], s["new_world"]) for s in starts]
    assert changes[0] == (None, 2) and (2, 4) in changes and changes[-1] == (4, 2), changes
    assert starts[-1]["plan_cached"], "world 2's plan was solved again instead of loaded from the cache"
    assert "mesh (2, 2)" in [s for s in starts if s["new_world"] == 4][-1]["new_plan"]
    assert "world changed: world 4 -> 2" in out_a

    got = _losses(tmp_path / "broken.jsonl")
    assert sorted(got) == list(range(STEPS))
    worlds = [got[s][1] for s in range(STEPS)]
    assert 4 in worlds and worlds[-1] == 2, f"premise: steps ran on worlds {worlds}"
    for step in range(STEPS):
        assert abs(got[step][0] - want[step][0]) <= 1e-4 * abs(want[step][0]), (step, got[step], want[step])
    mine, ref = _final_params(ck), _final_params(tmp_path / "ck_unbroken")
    assert sorted(mine) == sorted(ref)
    for name in ref:
        assert torch.allclose(mine[name], ref[name], rtol=1e-4, atol=1e-5), name


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """One run of the example from no checkpoint, stopped after 6 steps: (its folder, its output). Each
    test works on a copy of the folder (``_copy``)."""
    cwd = tmp_path_factory.mktemp("six_steps")
    return cwd, _example(cwd, "ck", "a.jsonl", "--stop-after", "6")


def _copy(run, tmp_path):
    shutil.copytree(run[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_no_checkpoint_starts_at_step_zero_and_a_restart_resumes(six_steps, tmp_path):
    out = six_steps[1]
    assert "no checkpoint yet: starting at step 0" in out and "done: steps 0..5" in out
    out = _example(_copy(six_steps, tmp_path), "ck", "a.jsonl", "--stop-after", "10")
    assert "restart on the same world: world 1 -> 1" in out and "resumed at step 6" in out
    assert "re-plan" in out and "from the plan cache" in out and "done: steps 6..9" in out


def test_a_checkpoint_of_another_model_is_refused(six_steps, tmp_path):
    done = subprocess.run([sys.executable, EXAMPLE, "--checkpoint-dir", "ck", *ARGS, "--width", "48"],
                          cwd=_copy(six_steps, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "CheckpointError" in done.stderr and "different model or batch shape (fingerprint" in done.stderr


def test_a_world_too_small_names_the_memory_it_needs(tmp_path):
    done = subprocess.run([sys.executable, EXAMPLE, "--checkpoint-dir", "ck", *ARGS, "--memory-limit", "100000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "InfeasiblePlanError" in done.stderr, done.stderr[-2000:]
    assert "no plan fits memory_limit=100000 bytes" in done.stderr and "the smallest plan needs" in done.stderr
    assert not os.path.exists(tmp_path / "ck" / "LATEST")
