"""Both cores: forked searches that share their best answer.

The problem is read and presolved once; ``fork_worker`` then forks (copy-on-write: no second
import, parse or presolve, so the start costs milliseconds, not the seconds a fresh interpreter
would), and the worker runs its own search with another seed. ``SharedBest`` is the incumbent
both see: the core total and the choice in an anonymous shared mapping with a sequence number,
written under a lock only when cheaper. Searches read it between their steps and adopt it when
it beats their own.

>>> shared = SharedBest(3)
>>> shared.offer(5.0, [0, 1, 2]), shared.offer(7.0, [1, 1, 1]), shared.read()[1:]
(True, False, (5.0, [0, 1, 2]))
"""
from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import signal
import sys
import time
from typing import Callable

import numpy as np

__all__ = ["SharedBest", "fork_worker", "wait_worker", "stop_worker"]


class SharedBest:
    """The cheapest (core total, choice) offered by any process, and the best lower bound,
    visible to all after a fork."""

    def __init__(self, n: int):
        self.n = n
        self._buf = mmap.mmap(-1, 24 + 8 * max(n, 1))  # anonymous and shared: survives fork
        self._head = np.frombuffer(self._buf, dtype=np.float64, count=3)   # [sequence, total, bound]
        self._choice = np.frombuffer(self._buf, dtype=np.int64, count=n, offset=24)
        self._head[:] = (0.0, np.inf, -np.inf)
        self._lock = multiprocessing.get_context("fork").Lock()

    @property
    def seq(self) -> int:
        return int(self._head[0])

    @property
    def total(self) -> float:
        return float(self._head[1])

    @property
    def bound(self) -> float:
        """The best lower bound any process offered (``-inf``: none)."""
        return float(self._head[2])

    def offer_bound(self, bound: float) -> None:
        with self._lock:
            self._head[2] = max(self._head[2], bound)

    def offer(self, total: float, choice) -> bool:
        """Keep ``choice`` when it is cheaper than the shared one; True when kept."""
        if not total < self._head[1]:  # cheap pre-check without the lock
            return False
        with self._lock:
            if not total < self._head[1]:
                return False
            self._choice[:] = choice
            self._head[1] = total
            self._head[0] += 1
            return True

    def read(self, timeout: float = -1) -> tuple[int, float, list[int]]:
        """(sequence number, total, choice) as one consistent snapshot; after ``timeout`` seconds
        without the lock (a writer killed while holding it), ``(-1, inf, [])``."""
        if not self._lock.acquire(timeout=None if timeout < 0 else timeout):
            return -1, float("inf"), []
        try:
            return int(self._head[0]), float(self._head[1]), self._choice.tolist()
        finally:
            self._lock.release()


def fork_worker(run: Callable[[], None]) -> int:
    """Run ``run()`` in a forked child that exits when it returns (or fails); the child's pid.
    The child's output goes nowhere: only the parent prints (the command's answer protocol);
    on Linux it is killed when the parent dies (a watchdog's SIGKILL leaves no orphan search)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            _die_with_parent()
            run()
        except BaseException:  # noqa: BLE001 - a worker's failure must not reach the parent's caller
            code = 1
        os._exit(code)
    return pid


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the worker still stops at its own deadline


def wait_worker(pid: int, deadline: float) -> None:
    """Let the worker end by itself until ``deadline`` (``time.perf_counter``), then stop it."""
    while time.perf_counter() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.02)
    stop_worker(pid)


def stop_worker(pid: int) -> None:
    """Stop a worker started by ``fork_worker`` and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
