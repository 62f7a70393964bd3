"""The process's own heap around a step: a check on ``MemTracker`` that no Python-level hook can skew.

``MemTracker`` counts the storages it sees made under its dispatch mode, plus what it is told to track;
it misses buffers made before it started and never touched (``runtime.gradsync``'s buckets until
the backward writes one) and it can change what a step keeps (``tracker_hooks``). glibc's allocator
knows what is really allocated: with ``M_MMAP_THRESHOLD`` fixed at 64 KiB (``use_mmap_for_large()``,
call it before the model is built) every allocation of 64 KiB or more is its own ``mmap``, on any
thread, and ``mallinfo2().hblkhd`` is their bytes (page-rounded, as the OS charges them).
``HeapProbe`` reads it after every ATen op of a step and keeps the largest rise over the step's start::

    use_mmap_for_large()                 # first thing in the rank
    ... build, compile, one step ...
    with HeapProbe() as probe:
        cm.step(x, target=y); opt.step()
    probe.peak_rise                      # bytes above what was allocated when the step began

Allocations under 64 KiB (scalars, norms' weights, Python objects) are not counted. Linux with
glibc only (``available()``).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Optional

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["available", "use_mmap_for_large", "mmapped_bytes", "HeapProbe", "MMAP_THRESHOLD"]

MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def available() -> bool:
    """Whether this process's allocator is glibc's with ``mallinfo2`` (glibc >= 2.33)."""
    return _LIBC is not None


def use_mmap_for_large(threshold: int = MMAP_THRESHOLD) -> None:
    """Every allocation of ``threshold`` bytes or more becomes its own mmap (and the dynamic threshold
    is off), so ``mmapped_bytes`` counts them all, whichever thread made them."""
    if _LIBC is None or _LIBC.mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        raise RuntimeError("glibc's mallopt(M_MMAP_THRESHOLD) is not available here: the heap probe needs Linux "
                           "with glibc")


def mmapped_bytes() -> int:
    """Bytes glibc holds in mmapped chunks now."""
    return int(_LIBC.mallinfo2().hblkhd)


class HeapProbe(TorchDispatchMode):
    """See the module docstring. ``peak_rise``: the largest ``mmapped_bytes`` after any op of the
    block, less its value when the block began; ``peak_op``: the op it was reached at."""

    def __init__(self) -> None:
        super().__init__()
        self.start = 0
        self.peak_rise = 0
        self.peak_op = ""

    def __enter__(self) -> "HeapProbe":
        gc.collect()
        self.start = mmapped_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rise = mmapped_bytes() - self.start
        if rise > self.peak_rise:
            self.peak_rise, self.peak_op = rise, str(func)
        return out
