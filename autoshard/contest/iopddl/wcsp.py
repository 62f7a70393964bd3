"""The memory-free (priced) problem as a weighted CSP solved by toulbar2 (``pytoulbar2``).

Without its memory limit an IOPDDL core is a cost-function network: one variable per node, a
unary cost function per node and a binary one per edge. toulbar2 solves such networks with soft
arc consistency, variable elimination and hybrid best-first search; it finds far cheaper answers
than belief propagation on the contest instances and proves a lower bound (its dual bound) on
the way. The memory limit comes back as prices on usage (``penalties``): ``solve`` takes an
extra cost per strategy, ``extra[off[i] + s]``, added to node ``i``'s cost.

Costs are integers to toulbar2. Answers are decoded under costs rounded to the nearest integer;
the dual bound is taken from a model whose costs are rounded down, so it stays a lower bound of
the real-valued priced problem. Forbidden costs (at or above ``FORBIDDEN``) are hard.

>>> from autoshard.contest.iopddl.problem import Problem
>>> from autoshard.contest.iopddl.presolve import presolve
>>> chain = Problem([[0, 1], [3, 0], [0, 1]], [[0, 0]] * 3, [(0, 0)] * 3, [(0, 1), (1, 2)],
...                 [[0, 9, 9, 0], [0, 9, 9, 0]], None)
>>> model = WcspModel(presolve(chain, reduce=False))
>>> r = model.solve(np.zeros(model.size), time_limit_s=5)
>>> r.choice.tolist(), r.cost, r.bound
([1, 1, 1], 2.0, 2.0)
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from autoshard.contest.iopddl.problem import FORBIDDEN

try:  # an optional dependency: without it the search falls back to belief propagation
    import pytoulbar2
except ImportError:  # pragma: no cover - exercised only where the package is missing
    pytoulbar2 = None

__all__ = ["WcspModel", "WcspResult", "available"]


def available() -> bool:
    """Whether toulbar2 can be used (the ``pytoulbar2`` package is installed)."""
    return pytoulbar2 is not None


class WcspResult(NamedTuple):
    choice: Optional[np.ndarray]  # one strategy per core node (None: nothing found in time)
    cost: float                   # the priced cost of ``choice`` as toulbar2 counted it
    bound: float                  # toulbar2's dual bound: no answer of the priced problem costs less


class WcspModel:
    """The core's costs as flat lists, ready to be posted to toulbar2 with per-strategy extras."""

    def __init__(self, core):
        self.core = core
        self.sizes = np.array([len(c) for c in core.cost], dtype=np.int64)
        self.off = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.size = int(self.off[-1])
        self.unary = np.concatenate(core.cost) if core.n else np.zeros(0)
        self.edges = []  # (i, j, costs row-major as Python floats, forbidden as inf)
        self.const = 0.0  # edges whose matrix is one value: the same for every answer
        for i in range(core.n):
            for j, m in core.nbrs[i]:
                if i < j:
                    flat = m.ravel()
                    if (flat == flat[0]).all() and flat[0] < FORBIDDEN:
                        self.const += float(np.floor(flat[0]))
                        continue
                    self.edges.append((i, j, np.where(flat >= FORBIDDEN, np.inf, np.floor(flat)).tolist()))

    def solve(self, extra: np.ndarray, time_limit_s: float, *, seed: int = 1, lds: int = 0,
              floor: bool = False) -> WcspResult:
        """Minimise node cost + ``extra`` + edge costs within ``time_limit_s`` CPU seconds (toulbar2
        counts whole seconds, at least one). ``floor`` rounds the unary costs down (for bounds);
        ``lds`` > 0 runs limited-discrepancy search first (quicker good answers, weaker bounds)."""
        if pytoulbar2 is None:
            raise RuntimeError("pytoulbar2 is not installed; pip install pytoulbar2")
        core = self.core
        cost = self.unary + np.minimum(extra, FORBIDDEN)  # toulbar2 costs are 64-bit integers
        cost = np.floor(cost) if floor else np.round(cost)
        unary = np.where(self.unary >= FORBIDDEN, np.inf, cost)
        cfn = pytoulbar2.CFN(verbose=-1, seed=seed)
        if lds:
            cfn.Option.lds = lds
        const = self.const
        for i in range(core.n):
            cfn.AddVariable(f"x{i}", range(int(self.sizes[i])))
        for i in range(core.n):
            row = unary[self.off[i]:self.off[i + 1]]
            if np.isfinite(row).all() and (row == row[0]).all():
                const += float(row[0])
                continue
            cfn.AddFunction([i], row.tolist())
        for i, j, flat in self.edges:
            cfn.AddFunction([i, j], flat)
        try:
            res = cfn.Solve(timeLimit=max(1, int(math.ceil(time_limit_s))))
        except Exception:  # toulbar2 signals an empty problem (all hard) by a contradiction
            res = None
        bound = float(cfn.GetDDualBound()) + const
        if not res:
            return WcspResult(None, math.inf, bound)
        choice = np.array(res[0], dtype=np.int64)
        return WcspResult(choice, float(res[1]) + const, bound)
