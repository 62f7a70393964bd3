"""A segment tree over time points with range add and range maximum, both O(log T).

Memory checks of multi-node moves: each moved node adds its usage change over its interval, then
one maximum per interval says whether the limit still holds, without rescanning the profile.
Iterative, bottom-up layout (leaves at ``size + t``); ``d[p]`` is an add pending for the whole
subtree of ``p`` and ``t[p]`` the maximum of that subtree including the adds at ``p`` and below
(a query first hands the pending adds on its two boundary paths down to the children).

>>> tree = SegmentTree([1.0, 5.0, 2.0, 0.0])
>>> tree.add(0, 3, 2.0); tree.max(0, 4), tree.max(2, 4)
(7.0, 4.0)
>>> tree.add(1, 2, -5.0); tree.max(0, 4), tree.values().tolist()
(4.0, [3.0, 2.0, 4.0, 0.0])
"""
from __future__ import annotations

import numpy as np

__all__ = ["SegmentTree"]


class SegmentTree:
    """Values ``v[0..T-1]`` with ``add(lo, hi, x)`` (``v[lo:hi] += x``) and ``max(lo, hi)``."""

    def __init__(self, values):
        values = np.asarray(values, dtype=np.float64)
        self.n = n = max(1, len(values))
        self.h = max(1, (n - 1).bit_length())
        size = 1 << self.h
        self.size = size
        t = np.full(2 * size, -np.inf)
        t[size:size + len(values)] = values
        for p in range(size - 1, 0, -1):
            t[p] = max(t[2 * p], t[2 * p + 1])
        self.t = t.tolist()          # Python lists: single-element access is several times faster
        self.d = [0.0] * size

    def _rebuild(self, p: int) -> None:
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            a, b = t[2 * p], t[2 * p + 1]
            t[p] = (a if a > b else b) + d[p]

    def add(self, lo: int, hi: int, x: float) -> None:
        """``v[lo:hi] += x``."""
        if lo >= hi or not x:
            return
        t, d, size = self.t, self.d, self.size
        l0, r0 = lo + size, hi - 1 + size
        l, r = l0, hi + size
        while l < r:
            if l & 1:
                t[l] += x
                if l < size:
                    d[l] += x
                l += 1
            if r & 1:
                r -= 1
                t[r] += x
                if r < size:
                    d[r] += x
            l >>= 1
            r >>= 1
        self._rebuild(l0)
        self._rebuild(r0)

    def _push(self, p: int) -> None:
        """Hand the pending adds on the path from the root down to leaf ``p`` to the children."""
        t, d, size = self.t, self.d, self.size
        for s in range(self.h, 0, -1):
            i = p >> s
            x = d[i]
            if x:
                for c in (2 * i, 2 * i + 1):
                    t[c] += x
                    if c < size:
                        d[c] += x
                d[i] = 0.0

    def max(self, lo: int, hi: int) -> float:
        """``max(v[lo:hi])`` (``-inf`` for an empty range)."""
        if lo >= hi:
            return -np.inf
        t, size = self.t, self.size
        l, r = lo + size, hi + size
        self._push(l)
        self._push(r - 1)
        res = -np.inf
        while l < r:
            if l & 1:
                if t[l] > res:
                    res = t[l]
                l += 1
            if r & 1:
                r -= 1
                if t[r] > res:
                    res = t[r]
            l >>= 1
            r >>= 1
        return res

    def values(self) -> np.ndarray:
        """All ``T`` values (O(T log T); for checks and tests)."""
        return np.array([self.max(k, k + 1) for k in range(self.n)])
