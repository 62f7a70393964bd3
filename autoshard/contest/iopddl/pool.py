"""A pool of good feasible answers and their recombination.

``Pool`` keeps the ``capacity`` cheapest distinct answers (core totals and choices). Two answers
that are both good tend to agree on most nodes; where they differ lies the choice that matters.
``recombine`` re-solves exactly, with CP-SAT and the memory limit (``neighbourhood_search``), the
nodes on which two parents disagree, everything else fixed at the cheaper parent: the child is
at least as good as that parent and may take parts of either, or neither. When the disagreement
is larger than the model budget, a connected part of it (grown within the disagreement from a
random node) is re-solved.

>>> pool = Pool(2)
>>> pool.add(5.0, [0, 1]), pool.add(5.0, [0, 1]), pool.add(3.0, [1, 1]), pool.add(9.0, [0, 0])
(True, False, True, False)
>>> [t for t, _ in pool.items]
[3.0, 5.0]
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np

from autoshard.contest.iopddl.local_search import State
from autoshard.contest.iopddl.neighbourhood_search import solve_region
from autoshard.contest.iopddl.regions import RegionBuilder

__all__ = ["Pool", "recombine", "disagreement_region"]


class Pool:
    """The cheapest distinct answers seen, cheapest first."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self.items: list[tuple[float, np.ndarray]] = []

    def add(self, total: float, choice) -> bool:
        """Insert when distinct and among the ``capacity`` cheapest; True when inserted."""
        choice = np.asarray(choice, dtype=np.int64)
        if len(self.items) >= self.capacity and total >= self.items[-1][0]:
            return False
        for t, c in self.items:
            if t == total and np.array_equal(c, choice):
                return False
        self.items.append((float(total), choice.copy()))
        self.items.sort(key=lambda item: item[0])
        del self.items[self.capacity:]
        return True

    def best(self) -> Optional[tuple[float, np.ndarray]]:
        return self.items[0] if self.items else None

    def pair(self, rng: random.Random) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The best answer and another one drawn uniformly (None with fewer than two)."""
        if len(self.items) < 2:
            return None
        return self.items[0][1], self.items[rng.randrange(1, len(self.items))][1]


def disagreement_region(core, a, b, max_vars: int, rng: random.Random, adj=None) -> list[int]:
    """Nodes where ``a`` and ``b`` differ: all of them when their model fits ``max_vars``
    variables, else a connected part grown inside the disagreement from a random node."""
    diff = np.flatnonzero(np.asarray(a) != np.asarray(b))
    if len(diff) == 0:
        return []
    inside = set(diff.tolist())
    builder = RegionBuilder(core, max_vars, adj)
    order = diff.tolist()
    rng.shuffle(order)
    for seed in order:
        if builder.full():
            break
        if seed in builder.inside or not builder.try_add(seed):
            continue
        queue = [seed]
        k = 0
        while k < len(queue) and not builder.full():
            i = queue[k]
            k += 1
            for j, _ in core.nbrs[i]:
                if j in inside and builder.try_add(j):
                    queue.append(j)
    return builder.region


def recombine(core, a, b, time_limit_s: float, rng: random.Random, *, max_vars: int = 20_000,
              deadline: Optional[float] = None, adj=None) -> Optional[State]:
    """The child of parents ``a`` (the cheaper; the child starts from it) and ``b`` (see the
    module docstring); None when they agree everywhere or CP-SAT improved nothing."""
    region = disagreement_region(core, a, b, max_vars, rng, adj)
    if not region:
        return None
    state = State(core, a)
    res = solve_region(state, region, time_limit_s, seed=rng.randrange(1 << 30), deadline=deadline)
    return state if res.changed else None
