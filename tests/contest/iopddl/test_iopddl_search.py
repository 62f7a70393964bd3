"""The IOPDDL search's newer parts: the segment tree against a plain array, chain moves (a chain ICM
cannot move, memory kept), the toulbar2 network exact without memory, lower bounds at most the
brute-force optimum (exact CP-SAT path, toulbar2 path, the Lagrangian bound), the pool and its
recombination, the incumbent shared across a fork, and the two-process search end to end."""
from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest

from autoshard.contest.iopddl.chain_moves import ChainSearch
from autoshard.contest.iopddl.local_search import State, icm
from autoshard.contest.iopddl.parallel import SharedBest, fork_worker, wait_worker
from autoshard.contest.iopddl.penalties import interval_peaks, lower_bound
from autoshard.contest.iopddl.pool import Pool, recombine
from autoshard.contest.iopddl.presolve import presolve
from autoshard.contest.iopddl.problem import FORBIDDEN, Problem, verify
from autoshard.contest.iopddl.segment_tree import SegmentTree
from autoshard.contest.iopddl.solver import SearchConfig, solve_problem
from autoshard.contest.iopddl.wcsp import WcspModel, available

# toulbar2 is an optional extra (autoshard[solver]; the dev extra CI installs includes it)
needs_toulbar2 = pytest.mark.skipif(not available(), reason="pytoulbar2 is not installed: pip install 'autoshard[solver]'")


def _optimum(p: Problem, memory: bool = True):
    """(cost, choice) of the cheapest answer by enumeration (memory ignored unless ``memory``)."""
    best = (None, None)
    for combo in itertools.product(*[range(len(c)) for c in p.costs]):
        v = verify(p, list(combo))
        forbidden = v.cost >= FORBIDDEN
        if forbidden or (memory and not v.feasible):
            continue
        if best[0] is None or v.cost < best[0]:
            best = (v.cost, list(combo))
    return best


def _random_problem(rng: random.Random, n: int, edges: int) -> Problem:
    strats = [rng.randint(2, 3) for _ in range(n)]
    costs = [[rng.randint(0, 20) for _ in range(s)] for s in strats]
    usages = [[rng.randint(0, 10) for _ in range(s)] for s in strats]
    intervals = []
    for _ in range(n):
        lo = rng.randint(0, 4)
        intervals.append((lo, lo + rng.randint(1, 4)))
    pairs = [tuple(rng.sample(range(n), 2)) for _ in range(edges)]
    ecosts = [[rng.choice([0, 0, rng.randint(1, 30)]) for _ in range(strats[u] * strats[v])] for u, v in pairs]
    p = Problem(costs, usages, intervals, pairs, ecosts, None)
    low = verify(p, [int(np.argmin(u)) for u in usages]).peak
    free = verify(p, _optimum(p, memory=False)[1]).peak
    p.usage_limit = rng.randint(low, max(low, free - 1))  # binding whenever it can be
    return p


def test_segment_tree_matches_an_array():
    rng = random.Random(3)
    for size in (1, 2, 7, 64, 100):
        ref = np.array([rng.uniform(-5, 5) for _ in range(size)])
        tree = SegmentTree(ref)
        for _ in range(500):
            lo = rng.randrange(size)
            hi = rng.randrange(lo, size + 1)
            if rng.random() < 0.5:
                x = rng.uniform(-3, 3)
                tree.add(lo, hi, x)
                ref[lo:hi] += x
            else:
                assert tree.max(lo, hi) == pytest.approx(ref[lo:hi].max() if hi > lo else -np.inf)
        assert np.allclose(tree.values(), ref)


def _chain_problem(limit):
    """Five nodes in a chain whose edges charge 10 for disagreeing: all at 0 costs 5, all at 1
    costs 0, and a single node moving alone pays 10 or 20 (ICM is stuck at all-0). Strategy 1 of
    node 2 uses 3 memory units where strategy 0 uses 1."""
    n = 5
    costs = [[1, 0]] * n
    usages = [[1, 1], [1, 1], [1, 3], [1, 1], [1, 1]]
    edges = [(i, i + 1) for i in range(n - 1)]
    return Problem(costs, usages, [(0, 1)] * n, edges, [[0, 10, 10, 0]] * len(edges), limit)


def test_chain_move_moves_what_icm_cannot_and_keeps_memory():
    core = presolve(_chain_problem(limit=10), reduce=False)
    state = State(core, [0] * 5)
    assert icm(state, float("inf")) == 0  # stuck
    gain = ChainSearch(state).try_chain(0, 1)
    assert gain == pytest.approx(5.0) and state.choice.tolist() == [1] * 5
    assert state.total() == 0.0 and state.feasible() and np.allclose(state.load[:1], [7.0])

    tight = presolve(_chain_problem(limit=6), reduce=False)  # all at 1 would need 7
    state = State(tight, [0] * 5)
    search = ChainSearch(state)
    assert search.try_chain(0, 1) == 0.0  # node 2 cannot follow: the chain breaks off and is undone
    assert state.feasible() and state.choice.tolist() == [0] * 5
    assert np.allclose(search.tree.values(), state.load)  # undone moves left the profile as it was


@needs_toulbar2
def test_toulbar2_is_exact_without_memory():
    rng = random.Random(11)
    for _ in range(5):
        p = _random_problem(rng, 6, 9)
        core = presolve(p, reduce=False)
        res = WcspModel(core).solve(np.zeros(sum(len(c) for c in core.cost)), time_limit_s=5)
        want, _ = _optimum(p, memory=False)
        assert verify(p, res.choice.tolist()).cost == want
        assert res.bound <= want + 1e-6


@needs_toulbar2
def test_lower_bounds_never_exceed_the_optimum():
    rng = random.Random(7)
    for k in range(4):
        p = _random_problem(rng, 7, 10)
        opt, _ = _optimum(p)
        if opt is None:
            continue
        exact = solve_problem(p, timeout_s=10)
        assert exact.cost == opt and exact.lower_bound == opt  # CP-SAT proves it
        for whole in (0, 10 ** 6):  # the memory-free bound alone; with CP-SAT's on everything
            got = solve_problem(p, timeout_s=3, config=SearchConfig(exact_max_vars=0, whole_max_vars=whole,
                                                                    processes=1, margin_s=0.2))
            assert got.stats["mode"] == "wcsp"
            assert got.lower_bound is not None and got.lower_bound <= opt <= got.cost
            assert verify(p, got.choice).feasible
        core = presolve(p, reduce=False)
        free = State(core, WcspModel(core).solve(np.zeros(sum(len(c) for c in core.cost)), 5).choice)
        # the core of an unreduced problem has the real costs: no offset
        assert lower_bound(core, WcspModel(core), free, float("inf"), time_limit_s=2) <= opt + 1e-6


def test_interval_peaks_are_the_maxima_over_each_interval():
    rng = random.Random(2)
    p = _random_problem(rng, 12, 15)
    core = presolve(p, reduce=False)
    state = State(core, [rng.randrange(len(c)) for c in p.costs])
    want = [state.load[lo:hi].max() if lo < hi else -np.inf for lo, hi in zip(core.lo, core.hi)]
    assert np.allclose(interval_peaks(state), want)


def test_pool_keeps_the_best_distinct_and_recombines_without_losing():
    pool = Pool(3)
    for total, choice in [(5.0, [0, 1]), (5.0, [0, 1]), (4.0, [1, 1]), (9.0, [0, 0]), (3.0, [1, 0])]:
        pool.add(total, choice)
    assert [t for t, _ in pool.items] == [3.0, 4.0, 5.0]
    rng = random.Random(5)
    p = _random_problem(rng, 8, 12)
    core = presolve(p, reduce=False)
    opt, _ = _optimum(p)
    a, b = State(core, [int(np.argmin(u)) for u in p.usages]), State(core, [int(np.argmin(u)) for u in p.usages])
    icm(a, float("inf"))
    b.choice[:] = [rng.randrange(len(c)) for c in p.costs]
    child = recombine(core, a.choice, b.choice, 5.0, rng)
    if child is not None:  # never worse than the parent it starts from, never over the limit
        assert child.feasible() and opt <= child.total() <= a.total()


def test_shared_best_crosses_a_fork():
    shared = SharedBest(4)
    shared.offer(10.0, [0, 0, 0, 0])
    pid = fork_worker(lambda: shared.offer(3.0, [1, 2, 3, 4]))
    wait_worker(pid, float("inf"))
    seq, total, choice = shared.read()
    assert (total, choice) == (3.0, [1, 2, 3, 4]) and seq == 2
    assert os.getpid() != pid


@needs_toulbar2
@pytest.mark.parametrize("worker", ["bp", "wcsp"])
def test_two_process_search_on_a_larger_instance(worker):
    rng = random.Random(5)
    n = 300
    strats = [rng.randint(2, 4) for _ in range(n)]
    p = Problem([[rng.randint(0, 50) for _ in range(s)] for s in strats],
                [[rng.randint(1, 10) for _ in range(s)] for s in strats],
                [(t, t + rng.randint(1, 30)) for t in (rng.randint(0, 200) for _ in range(n))],
                [(i, rng.randrange(i)) for i in range(1, n)] + [tuple(rng.sample(range(n), 2)) for _ in range(n // 2)],
                [], None)
    p.edge_costs = [[rng.choice([0, rng.randint(1, 40)]) for _ in range(strats[u] * strats[v])] for u, v in p.edges]
    p.usage_limit = int(verify(p, [int(np.argmin(u)) for u in p.usages]).peak * 1.3)
    seen = []
    bounds = []
    got = solve_problem(p, timeout_s=10, config=SearchConfig(exact_max_vars=0, solve_s=1, processes=2, worker=worker),
                        on_progress=lambda t, c: seen.append(c), on_bound=bounds.append)
    assert got.stats["mode"] == "wcsp" and got.stats["processes"] == 2 and got.stats["worker"] == worker
    assert bounds == sorted(bounds) and bounds[-1] == got.lower_bound  # reported as they improved
    assert got.choice and verify(p, got.choice).feasible and got.cost == seen[-1]
    assert seen == sorted(seen, reverse=True)
    assert got.lower_bound is not None and got.lower_bound <= got.cost
