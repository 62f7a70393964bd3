"""Collective timing: seconds per call of each collective kind over groups of ``n`` ranks.

``rank_groups`` makes a rank's groups of ``n``: the whole world when ``n == world``, else its group
of ``n`` consecutive ranks and its group of ``n`` ranks ``world // n`` apart -- the groups of the last
and of the first axis of an ``(n, world // n)`` mesh. ``time_collective`` alternates its calls
between those two groups, because a plan on a 2-D mesh interleaves collectives on both axes (an
FSDP weight is all-gathered on one axis, then on the other): each call then waits for the slowest
rank of the whole world, not just of its own group. (On 4 gloo ranks sharing 2 cores, a size-2
all-gather or reduce-scatter timed on isolated pairs ran 1.3-2.2x faster than inside such a chain,
and (2, 2) FSDP steps priced with those fits were underestimated by 40-50%.) Sizes are the full
per-group bytes B of ``passes/cost/collectives.py``.

``local_work``: in a step every collective follows local work (a layer norm, an activation) that
the ranks run at once, and on ranks sharing cores they reach the collective at different times and
have gone to sleep in it; back-to-back calls in a loop keep the ranks in lockstep instead. On the
project's 2-core box (4 gloo ranks), a 128 KiB all-gather, all-reduce or all-to-all took 1.5-2x as
long after 0.2-0.6 ms of such work than in a loop, and in the fidelity steps (``benchmarks/
fidelity_breakdown.py``) a call took 2-3x the loop's time. So on a CPU each timed call follows
``local_work()`` on every rank, and the seconds that work takes alone (timed the same way, every
rank busy) are subtracted: what remains is what the call adds to a step.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from autoshard.profiling.timer import Timer, calls_per_batch

__all__ = ["rank_groups", "time_collective"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_groups(world: int, n: int, rank: int) -> list:
    """This rank's groups of ``n``: [the WORLD] for ``n == world``; else [its group of ``n``
    consecutive ranks, its group of ``n`` ranks ``world // n`` apart] -- the groups of the last and
    of the first axis of a ``(n, world // n)`` mesh. Every rank creates every group, in one order."""
    if n == world:
        return [dist.group.WORLD]
    mine = [None, None]
    stride = world // n
    for start in range(0, world, n):
        g = dist.new_group(list(range(start, start + n)))
        if start <= rank < start + n:
            mine[0] = g
    for first in range(stride):
        g = dist.new_group(list(range(first, world, stride)))
        if rank % stride == first:
            mine[1] = g
    return mine


def time_collective(timer: Timer, kind: str, n: int, groups: list, rank: int, sizes, device, backend: str,
                    local_work: Optional[Callable[[], object]] = None) -> list:
    """[B, seconds per call] for each size. With two groups (``n < world``) the calls alternate
    between them, as collectives on the axes of a 2-D mesh do in a step: every rank then waits for
    ranks outside its own group too, which groups timed alone in a loop never do. ``local_work``:
    run before each call on every rank, its own time subtracted (see the module docstring)."""
    rows = []
    for B in sizes:
        unit = n * n
        elems = max(unit, int(B) // 4 // unit * unit)
        full = torch.ones(elems, dtype=torch.float32, device=device)
        piece = torch.ones(elems // n, dtype=torch.float32, device=device)
        out = torch.empty_like(piece)
        recv = torch.empty_like(full)

        def call(group):
            if kind == "all_reduce":
                dist.all_reduce(full, group=group)
            elif kind == "all_gather":
                _all_gather_single(full, piece, group=group)
            elif kind == "reduce_scatter":
                _reduce_scatter_single(piece, full, group=group)
            elif kind == "all_to_all":
                dist.all_to_all_single(out, piece, group=group)
            else:  # send_recv: pairs (2i, 2i+1) exchange one message each way
                peer = rank ^ 1
                if backend == "gloo":
                    works = [dist.isend(full, peer), dist.irecv(recv, peer)]
                else:
                    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer),
                                                    dist.P2POp(dist.irecv, recv, peer)])
                for w in works:
                    w.wait()
        if kind == "send_recv":
            groups = groups[:1]  # point-to-point: no group

        iters = calls_per_batch(elems * 4 * len(groups))
        if local_work is None:
            def fn():
                for g in groups:
                    call(g)
            rows.append([elems * 4, timer(fn, iters) / len(groups)])
            continue

        def after_work():
            for g in groups:
                local_work()
                call(g)

        def work_alone():
            for _ in groups:
                local_work()
        both = timer(after_work, iters, fence=True)
        alone = timer(work_alone, iters, fence=True)
        # the difference of two noisy medians can come out <= 0 for a tiny call; the fits need t > 0
        rows.append([elems * 4, max(both - alone, 1e-6) / len(groups)])
    return rows
