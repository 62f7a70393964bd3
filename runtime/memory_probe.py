"""Measure a training step's memory on one rank: what autograd keeps, and the parameter copies alive.

    with MemoryProbe(rank_program) as probe:
        rank_program.step(x, target=y)
    probe.saved_bytes, probe.gathered_peak_bytes

- ``saved_bytes``: bytes of the storages created during a forward and still alive when it returns
  (largest over the step's microsteps). The program frees every value after its last use, so what
  is alive then is what autograd keeps for backward, whichever mechanism keeps it (plain saved
  tensors, a checkpoint region's inputs, selective checkpointing's kept matmul outputs), plus the
  returned loss. Storages of the parameters, buffers and inputs (and views of them) are not
  counted, nor parameter copies (reported apart): the same rule as the planner's estimate.
  Storages are followed by a ``TorchDispatchMode`` seeing every op's outputs and weak references.
- ``gathered_peak_bytes``: the most bytes of parameter copies (gathered or cast by the program's
  ``param_gather.ParamGatherer``) alive at once during the step, forward and backward.

``estimate_gap(measured, estimated)`` is the relative difference the tests bound (|m - e| / e).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryProbe", "estimate_gap"]


def estimate_gap(measured: float, estimated: float) -> float:
    """|measured - estimated| / estimated (inf when the estimate is 0 and the measure is not)."""
    if estimated == 0:
        return 0.0 if measured == 0 else float("inf")
    return abs(measured - estimated) / estimated


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _key(t: torch.Tensor):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, None
    return StorageWeakRef(storage), storage.nbytes()


class _NewStorages(TorchDispatchMode):
    """Records the storage of every op output (weakly)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            ref, nbytes = _key(t)
            if ref is not None and ref.cdata not in self.seen:
                self.seen[ref.cdata] = (ref, nbytes)
        return out


class MemoryProbe:
    """Measures one or more steps of ``program`` (a ``RankProgram``); see the module docstring."""

    def __init__(self, program):
        self.program = program
        self.saved_bytes = 0
        self.gathered_peak_bytes = 0

    def __enter__(self) -> "MemoryProbe":
        self.saved_bytes = 0
        self.gathered_peak_bytes = 0
        if self.program.gatherer is not None:
            self.program.gatherer.reset_peak()
        self.program.memory_probe = self
        return self

    def __exit__(self, *exc) -> None:
        self.program.memory_probe = None
        if self.program.gatherer is not None:
            self.gathered_peak_bytes = self.program.gatherer.peak_bytes

    @contextlib.contextmanager
    def forward(self, state: Sequence):
        """Around one forward: ``state`` holds the parameters, buffers and inputs it receives."""
        excluded = set()
        for t in _tensors(list(state)):
            ref, _ = _key(t)
            if ref is not None:
                excluded.add(ref.cdata)
        tracker = _NewStorages()
        with tracker:
            yield
        gc.collect()  # storages only a collected reference cycle still held are not kept for backward
        gatherer = self.program.gatherer
        alive = 0
        for cdata, (ref, nbytes) in tracker.seen.items():
            if cdata in excluded or ref.expired():
                continue
            if gatherer is not None and cdata in gatherer.copy_keys():
                continue
            alive += nbytes
        self.saved_bytes = max(self.saved_bytes, alive)
