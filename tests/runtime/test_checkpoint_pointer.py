"""A save or a reshard killed at any moment leaves the previous checkpoint loadable
(``runtime.checkpoint_pointer``).

A child process saves step 10, then starts saving step 20 and SIGKILLs itself at one of two moments:
after writing its shards but before the metadata (the directory is half written), or after the whole
checkpoint is on disk but before ``LATEST`` is switched. Either way ``LATEST`` still names step 10, whose
values load back exactly; the next save succeeds and removes the half-written directory. A load killed
midway (a rank dying in the reshard) changes no file and the checkpoint loads again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from autoshard.runtime.checkpoint_files import load
from autoshard.runtime.checkpoint_pointer import POINTER_FILE, latest_checkpoint, save_checkpoint
from autoshard.passes.errors import CheckpointError

CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from autoshard.runtime import checkpoint_files, checkpoint_pointer
    root, moment = sys.argv[1], sys.argv[2]
    def state(v):
        return {"w": torch.full((64, 8), float(v)), "progress": {"next_step": v}}
    checkpoint_pointer.save_checkpoint(state(10), root, 10)
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if moment == "before-metadata":
        checkpoint_files.JsonFileWriter.finish = die
    else:
        checkpoint_pointer._write_pointer = die
    checkpoint_pointer.save_checkpoint(state(20), root, 20)
    print("the save was not killed")
""")


@pytest.mark.parametrize("moment", ["before-metadata", "before-pointer-switch"])
def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, moment):
    root = str(tmp_path / "ck")
    child = subprocess.run([sys.executable, "-c", CHILD, root, moment], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    dirs = sorted(os.listdir(root))
    assert len([d for d in dirs if d.startswith("step_00000020-")]) == 1, f"premise: the killed save began: {dirs}"
    path, step = latest_checkpoint(root)
    assert step == 10 and os.path.basename(path).startswith("step_00000010-")
    state = {"w": torch.zeros(64, 8), "progress": {"next_step": 0}}
    load(state, path)
    assert torch.equal(state["w"], torch.full((64, 8), 10.0)) and state["progress"]["next_step"] == 10

    newest = save_checkpoint({"w": torch.full((64, 8), 30.0), "progress": {"next_step": 30}}, root, 30)
    assert latest_checkpoint(root) == (newest, 30)
    left = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    assert [d[:13] for d in left] == ["step_00000010", "step_00000030"], left  # the killed save's directory is gone, the previous stays


def test_no_pointer_means_no_checkpoint_and_a_dangling_pointer_is_an_error(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / POINTER_FILE).write_text('{"directory": "step_00000005-deadbeef", "step": 5}')
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        latest_checkpoint(str(tmp_path))


RESHARD_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from autoshard.runtime import checkpoint_files
    from autoshard.runtime.checkpoint_pointer import latest_checkpoint
    path, _ = latest_checkpoint(sys.argv[1])
    real = checkpoint_files.JsonFileReader.read_data
    def read_then_die(self, plan, planner):
        real(self, plan, planner)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint_files.JsonFileReader.read_data = read_then_die
    checkpoint_files.load({"w": torch.zeros(64, 8), "progress": {"next_step": 0}}, path)
    print("the load was not killed")
""")


def test_a_rank_killed_while_resharding_leaves_the_checkpoint_as_it_was(tmp_path):
    root = str(tmp_path / "ck")
    path = save_checkpoint({"w": torch.arange(512.0).reshape(64, 8), "progress": {"next_step": 10}}, root, 10)
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    pointer = open(os.path.join(root, POINTER_FILE)).read()
    child = subprocess.run([sys.executable, "-c", RESHARD_CHILD, root], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
    assert open(os.path.join(root, POINTER_FILE)).read() == pointer
    state = {"w": torch.zeros(64, 8), "progress": {"next_step": 0}}
    load(state, latest_checkpoint(root)[0])
    assert torch.equal(state["w"], torch.arange(512.0).reshape(64, 8)) and state["progress"]["next_step"] == 10
