"""Checkpoints that a killed save cannot damage: a new directory per save, then a pointer switched atomically.

    <root>/step_00000020-3f9c1a2b/    a complete checkpoint (``checkpoint_files``: rank<i>.bin, .metadata.json)
    <root>/step_00000030-77d0e41c/    the newest one
    <root>/LATEST                     {"directory": "step_00000030-77d0e41c", "step": 30}

``save_checkpoint`` writes every rank's shards into a directory no earlier save used (its name is
chosen on rank 0 and sent to every rank), and only once the whole checkpoint is on disk does rank 0
write ``LATEST.tmp`` and ``os.replace`` it onto ``LATEST``: a POSIX rename is atomic, so ``LATEST``
names either the old complete checkpoint or the new complete one, whatever moment a rank dies at (in
the write, between the write and the switch, or in a reshard that reads it afterwards). Old
directories (half-written ones and ones a killed save finished but never pointed at included) are
removed after the switch: only the new checkpoint and, with ``keep_previous``, the one ``LATEST``
named before it stay. ``latest_checkpoint`` reads the pointer (None when no save finished yet).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Optional

import torch.distributed as dist

from autoshard.passes.errors import CheckpointError
from autoshard.runtime.checkpoint_files import METADATA_FILE, save
from autoshard.runtime.groups import broadcast_json

__all__ = ["save_checkpoint", "latest_checkpoint", "checkpoint_info", "POINTER_FILE"]

POINTER_FILE = "LATEST"
_DIRECTORY = re.compile(r"step_(\d+)-[0-9a-f]+")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(state: dict, root: str, step: int, *, keep_previous: bool = True,
                    info: Optional[dict] = None) -> str:
    """Save ``state`` (``checkpoint_files.save``) as the checkpoint of ``step`` under ``root`` and point
    ``LATEST`` at it; every rank calls it. Returns the new directory. ``keep_previous``: keep the
    checkpoint ``LATEST`` named before (else only the new one stays). ``info``: JSON-able facts about
    the run that saved it (model fingerprint, world, plan), stored in ``LATEST`` itself so they switch
    with it (``checkpoint_info`` reads them back)."""
    name = f"step_{step:08d}-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None
    name = broadcast_json(name)
    path = os.path.join(root, name)
    save(state, path)  # returns on every rank once rank 0 has written the metadata (the last file)
    if _rank() == 0:
        previous = _pointed(root) if keep_previous else None
        _write_pointer(root, {**(info or {}), "directory": name, "step": int(step)})
        _remove_stale(root, {name, previous})
    return path


def latest_checkpoint(root: str) -> Optional[tuple[str, int]]:
    """(directory, step) of the checkpoint ``LATEST`` names under ``root``; None when there is none yet.
    CheckpointError when the pointer names a checkpoint that is not there (someone deleted it)."""
    info = checkpoint_info(root)
    return None if info is None else (info["path"], info["step"])


def checkpoint_info(root: str) -> Optional[dict]:
    """What ``LATEST`` under ``root`` says: ``save_checkpoint``'s ``info``, plus ``step`` and ``path`` (the
    checkpoint's directory); None when no save finished yet. CheckpointError as ``latest_checkpoint``."""
    where = os.path.join(root, POINTER_FILE)
    if not os.path.exists(where):
        return None
    try:
        with open(where, encoding="utf-8") as f:
            doc = json.load(f)
        name, step = str(doc["directory"]), int(doc["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where} is malformed ({e}); it is written atomically, so something else wrote "
                              "it: delete it to start from step 0, or point it at a complete checkpoint") from e
    path = os.path.join(root, name)
    if os.path.basename(name) != name or not os.path.exists(os.path.join(path, METADATA_FILE)):
        raise CheckpointError(f"{where} names {name!r}, which holds no complete checkpoint: was it deleted?")
    return {**doc, "step": step, "path": path}


def _write_pointer(root: str, doc: dict) -> None:
    tmp = os.path.join(root, POINTER_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, POINTER_FILE))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def _pointed(root: str) -> Optional[str]:
    """The directory name ``LATEST`` holds now (None without a readable pointer)."""
    try:
        with open(os.path.join(root, POINTER_FILE), encoding="utf-8") as f:
            return str(json.load(f)["directory"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_stale(root: str, kept: set) -> None:
    """Delete every checkpoint directory under ``root`` whose name is not in ``kept``."""
    for name in os.listdir(root):
        if _DIRECTORY.fullmatch(name) and name not in kept:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
