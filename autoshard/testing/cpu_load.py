"""Busy cores for tests that check a result does not depend on the machine's load.

>>> with busy_cores(2):          # doctest: +SKIP
...     loaded = plan_something()
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Iterator

__all__ = ["busy_cores"]


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@contextlib.contextmanager
def busy_cores(processes: int = 2) -> Iterator[None]:
    """Run ``processes`` spinning processes (spawned, daemonic) for the duration of the block."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(processes)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=10)
