"""Live tensor bytes around a step, counted with no module or gradient hooks at all: a referee for
``MemTracker``, whose module tracking registers autograd hooks that can change what a step keeps
(``tracker_hooks``).

``StorageProbe`` is a bare dispatch mode: every storage an op returns that it has not seen, and that no
operand of that op already had (a view, an in-place result), is counted until it is freed (a weakref
finalizer); ``peak`` is the most bytes alive at once after any op. Storages made before the step
(parameters, optimizer state, buckets) are passed in as ``known`` and counted by the caller::

    with StorageProbe(known=state_storages) as probe:
        cm.step(x, target=y); opt.step()
    probe.peak + state_bytes              # the step's peak
"""
from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StorageProbe", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """An identity for ``t``'s storage (the same for every view of it)."""
    return t.untyped_storage()._cdata


class StorageProbe(TorchDispatchMode):
    """See the module docstring. ``known``: storage keys never counted."""

    def __init__(self, known=()) -> None:
        super().__init__()
        self.known = set(known)
        self.alive: dict[int, int] = {}
        self.peak = 0
        self.peak_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.alive and key not in self.known and key not in read:
                    self.alive[key] = st.nbytes()
                    weakref.finalize(st, self.alive.pop, key, None)
        now = sum(self.alive.values())
        if now > self.peak:
            self.peak, self.peak_op = now, str(func)
        return out
