"""What is alive at a step's measured memory peak, storage by storage: a ``MemTracker`` that tags.

``PeakTags`` is a ``MicrostepTracker`` (torch's ``MemTracker``) that tags every storage it sees made
with the op that made it, the phase (forward or backward), whether a recompute region made it
(MemTracker's own activation-checkpointing flag) and the autograd node running then; at each new
peak it keeps the live bytes grouped by (category, tag). ``peak_tags()`` returns them, largest
first, next to the op running at the peak. Used to find what the estimate's step walk
(``passes.solve.peak_timeline``) misses (``benchmarks/RESULTS.md``, issue 21)::

    tracker = PeakTags()
    tracker.track_external(local_module(program), optimizer)
    with tracker:
        program.step(x, target=y); optimizer.step()
    at, rows = tracker.peak_tags()     # rows: [(bytes, category, Tag), ...]

Storages that existed before the tracker (parameters, optimizer state) carry no tag (``None``).
Its hooks run on every op and every new peak: a diagnostic, slower than ``MemTracker``.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

import torch
from torch.distributed._tools.mem_tracker import get_untyped_storages

from .memory_estimates import MicrostepTracker

__all__ = ["Tag", "PeakTags"]


class Tag(NamedTuple):
    """Where a storage was made: the op, in the backward or not, in a recompute region or not, the
    autograd node running (None in the forward), and the tensor's shape."""
    op: str
    backward: bool
    recompute: bool
    node: Optional[str]
    shape: tuple


class PeakTags(MicrostepTracker):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._tags: dict[int, Tag] = {}  # id of MemTracker's record of a storage -> its tag
        self._now: tuple = ("", False, False, None)
        self._at_peak: tuple = self._now
        self._live_at_peak: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        self._now = (str(func.__name__), bool(self._mod_tracker.is_bw), bool(self._in_ac),
                     node.name() if node is not None else None)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t: torch.Tensor) -> None:
        fresh = [st for st in get_untyped_storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        for st in fresh:
            record = self._WINFO.get(st, (None, None))[0]
            if record is not None:
                self._tags[id(record)] = Tag(*self._now, tuple(t.shape))

    def _update_peak_stats(self, peak_state) -> None:
        before = sum(self._peak_mem.values())
        super()._update_peak_stats(peak_state)
        if sum(self._peak_mem.values()) > before:
            live: Counter = Counter()
            for record, _ in list(self._WINFO.values()):
                if record is not None and record.mem_consumed:
                    live[(str(record.reftype.value), self._tags.get(id(record)))] += record.mem_consumed
            self._live_at_peak, self._at_peak = live, self._now

    def peak_tags(self) -> tuple[tuple, list[tuple[int, str, Optional[Tag]]]]:
        """(the op running at the peak: (op, backward, recompute, autograd node)), and the live bytes
        then as ``[(bytes, category, tag or None), ...]``, largest first."""
        rows = sorted(((b, cat, tag) for (cat, tag), b in self._live_at_peak.items()),
                      key=lambda r: (-r[0], r[1], str(r[2])))
        return self._at_peak, rows
