"""Kill a rank mid-run under torchrun, restart from the last checkpoint: the run goes on as if unbroken.

``examples/train_gpt.py`` on 2 CPU ranks (a real ``python -m torch.distributed.run``), 60 steps,
a checkpoint every 10. One run goes through; another, launched beside it in another directory, has
one rank SIGKILLed once its first checkpoint is complete: torchrun ends every rank and fails. Restarted with ``--resume`` (same mesh, so the plan
saved with the checkpoints), the losses after the checkpoint equal the unbroken run's bit for bit;
restarted from a copy of the same checkpoint as a 2-stage pipeline (another plan, launched beside
the first restart), within float tolerance.
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

from autoshard.testing.ranks import free_port

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
STEPS, EVERY = 60, 10


def _launch(cwd, ckpt: str, log: str, *extra: str) -> subprocess.Popen:
    """One torchrun of the example on its own free port, its output in ``<log>.out`` and its drawings
    named after ``log``: two runs go side by side (while one's rank 0 plans, its rank 1 waits and the
    other run's ranks use the core)."""
    stem = os.path.splitext(log)[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--monitor-interval", "0.1", "--master-port", str(free_port()), os.path.abspath(EXAMPLE),
           "--mesh", "2", "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--checkpoint-dir", ckpt,
           "--loss-log", log, "--plan-svg", f"{stem}_plan.svg", "--trace", f"{stem}_trace.json", *extra]
    with open(os.path.join(cwd, f"{stem}.out"), "w") as out:  # a file, not a pipe nobody drains meanwhile
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.out_path = out.name
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    proc.wait(timeout=timeout)
    with open(proc.out_path) as f:
        return f.read()


def _losses(path) -> dict:
    with open(path) as f:
        return {d["step"]: float.fromhex(d["loss"]) for d in map(json.loads, f)}


def _ranks(agent: int) -> list[int]:
    """The torchrun agent's child processes that run the example (its ranks)."""
    kids = []
    for task in os.listdir(f"/proc/{agent}/task"):
        with open(f"/proc/{agent}/task/{task}/children") as f:
            kids += [int(p) for p in f.read().split()]
    mine = []
    for pid in kids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"train_gpt.py" in f.read():
                    mine.append(pid)
        except OSError:
            pass
    return sorted(mine)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's ranks through /proc")
def test_sigkill_one_rank_then_resume_equals_an_unbroken_run(tmp_path):
    unbroken = _launch(tmp_path, "ck_unbroken", "unbroken.jsonl")
    broken = _launch(tmp_path, "ck", "broken.jsonl")  # at the same time: the two runs share nothing
    first = tmp_path / "ck" / f"step_{EVERY}" / ".metadata.json"
    deadline = time.monotonic() + 240
    while not first.exists():
        assert broken.poll() is None and time.monotonic() < deadline, _finish(broken)[-3000:]
        time.sleep(0.02)
    ranks = _ranks(broken.pid)
    assert len(ranks) == 2, f"premise: torchrun runs 2 ranks, found {ranks}"
    os.kill(ranks[1], signal.SIGKILL)
    out = _finish(broken)
    assert broken.returncode != 0, "torchrun reported success after a rank was killed"
    assert not any(_alive(pid) for pid in ranks), "a rank outlived the run"
    out = _finish(unbroken)
    assert unbroken.returncode == 0, out[-3000:]
    want = _losses(tmp_path / "unbroken.jsonl")
    assert sorted(want) == list(range(STEPS))
    done = _losses(tmp_path / "broken.jsonl")
    assert max(done) < STEPS - 1, "premise: the kill landed before the run finished"
    shutil.copytree(tmp_path / "ck", tmp_path / "ck_other_plan")

    resumed = _launch(tmp_path, "ck", "resumed.jsonl", "--resume")
    other = _launch(tmp_path, "ck_other_plan", "other.jsonl", "--resume", "--pp", "2")
    out = _finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    got = _losses(tmp_path / "resumed.jsonl")
    start = min(got)
    assert start % EVERY == 0 and start <= max(done) + 1 and f"at step {start}" in out
    assert got == {k: want[k] for k in range(start, STEPS)}, "the resumed run's losses differ from the unbroken run's"

    out = _finish(other)
    assert other.returncode == 0, out[-3000:]
    assert "pipeline: pp 2" in out
    got = _losses(tmp_path / "other.jsonl")
    assert sorted(got) == list(range(start, STEPS))
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-5 * abs(want[step]), (step, loss, want[step])
