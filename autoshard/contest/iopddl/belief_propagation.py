"""Min-sum loopy belief propagation (Pearl 1988; damped, synchronous) on a presolved IOPDDL ``Core``,
vectorised with numpy: edges are grouped by matrix shape and every group's messages are computed
in one array operation, so an iteration costs a few passes over all matrix entries.

It looks at every node and edge at once, which local moves cannot: where chains of must-agree
edges meet, changing one node costs a forbidden pair until its whole chain changes with it. Node
costs may carry memory prices (``lagrangian``); memory itself is not seen. Forbidden entries
are capped at ``cap`` (a large finite cost) so the arithmetic stays finite.

>>> from autoshard.contest.iopddl.problem import Problem
>>> from autoshard.contest.iopddl.presolve import presolve
>>> chain = Problem([[0, 1], [3, 0], [0, 1]], [[0, 0]] * 3, [(0, 0)] * 3, [(0, 1), (1, 2)],
...                 [[0, 9, 9, 0], [0, 9, 9, 0]], None)
>>> bp = BeliefPropagation(presolve(chain, reduce=False))
>>> bp.run(np.zeros(3), iters=10).tolist()   # all agree on 1: 1 + 0 + 1 beats 0 + 3 + 0
[1, 1, 1]
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN

__all__ = ["BeliefPropagation"]


class BeliefPropagation:
    """Messages of every directed edge, kept between ``run`` calls (warm starts)."""

    def __init__(self, core, cap: float | None = None):
        self.core = core
        sizes = np.array([len(c) for c in core.cost], dtype=np.int64)
        self.off = np.concatenate([[0], np.cumsum(sizes)])
        self.sizes = sizes
        finite = [float(m[m < FORBIDDEN].max(initial=0.0)) for nb in core.nbrs for _, m in nb]
        finite += [float(c[c < FORBIDDEN].max(initial=0.0)) for c in core.cost]
        self.cap = cap if cap is not None else 1e3 * max(finite, default=1.0) + 1e6
        self.unary = np.minimum(np.concatenate(core.cost), self.cap) if core.n else np.zeros(0)
        self._free_unary = self.unary.copy()
        self.clamps: dict[int, int] = {}
        buckets = defaultdict(list)
        for i in range(core.n):
            for j, m in core.nbrs[i]:
                if i < j:
                    buckets[m.shape].append((i, j, m))
        self.groups = []
        for (si, sj), items in buckets.items():
            ii = np.array([e[0] for e in items], dtype=np.int64)
            jj = np.array([e[1] for e in items], dtype=np.int64)
            mats = np.minimum(np.stack([e[2] for e in items]), self.cap)
            # flat positions of each edge's endpoint strategies in the node-belief vector
            pi = self.off[ii][:, None] + np.arange(si)[None, :]
            pj = self.off[jj][:, None] + np.arange(sj)[None, :]
            self.groups.append({"mats": mats, "pi": pi, "pj": pj, "buf": np.empty_like(mats),
                                "to_j": np.zeros((len(items), sj)), "to_i": np.zeros((len(items), si))})
        self.node_of = np.repeat(np.arange(core.n), sizes)

    def clamp(self, clamps: dict[int, int]) -> None:
        """Hold node ``i`` at strategy ``clamps[i]`` (its other strategies cost ``cap``) in later
        runs; an empty dict lifts every clamp. Conditioning on a hub's strategy picks one mode of
        the messages, where unclamped loopy BP can settle in a far worse one."""
        self.clamps = dict(clamps)
        self.unary = self._free_unary.copy()
        for i, s in self.clamps.items():
            lo, hi = self.off[i], self.off[i + 1]
            self.unary[lo:hi] = self.cap
            self.unary[lo + s] = self._free_unary[lo + s]

    def reset(self) -> None:
        """Forget all messages (the next ``run`` starts cold)."""
        for g in self.groups:
            g["to_j"][:] = 0.0
            g["to_i"][:] = 0.0

    def beliefs(self, unary: np.ndarray) -> np.ndarray:
        idx = [g["pj"].ravel() for g in self.groups] + [g["pi"].ravel() for g in self.groups]
        val = [g["to_j"].ravel() for g in self.groups] + [g["to_i"].ravel() for g in self.groups]
        if not idx:
            return unary.copy()
        return unary + np.bincount(np.concatenate(idx), weights=np.concatenate(val), minlength=len(unary))

    def decode(self, b: np.ndarray) -> np.ndarray:
        """Per node, the strategy of least belief."""
        out = np.empty(self.core.n, dtype=np.int64)
        # argmin within each node's slice: sort key (node, belief)
        order = np.lexsort((b, self.node_of))
        first = self.off[:-1]
        out[:] = order[first] - first
        return out

    def run(self, price: np.ndarray, iters: int = 30, damping: float = 0.5,
            deadline: float = float("inf")) -> np.ndarray:
        """``iters`` rounds for node costs plus ``price[i] * usage[i]``; the decoded choice."""
        core = self.core
        extra = np.concatenate([price[i] * core.usage[i] for i in range(core.n)]) if core.n else np.zeros(0)
        unary = self.unary + extra
        for _ in range(iters):
            if time.perf_counter() > deadline:
                break
            b = self.beliefs(unary)
            for g in self.groups:
                hi = b[g["pi"]] - g["to_i"]                     # what i knows, less what j told it
                hj = b[g["pj"]] - g["to_j"]
                buf = g["buf"]  # preallocated: these blocks are the size of all matrices together
                new_j = np.add(hi[:, :, None], g["mats"], out=buf).min(axis=1)
                new_i = np.add(hj[:, None, :], g["mats"], out=buf).min(axis=2)
                new_j -= new_j.min(axis=1, keepdims=True)
                new_i -= new_i.min(axis=1, keepdims=True)
                g["to_j"] = damping * g["to_j"] + (1 - damping) * new_j
                g["to_i"] = damping * g["to_i"] + (1 - damping) * new_i
        return self.decode(self.beliefs(unary))
