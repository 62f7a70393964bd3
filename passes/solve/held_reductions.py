"""Reduce FSDP gradients once per step where memory allows: the planner's choice of the ``once`` form.

Under gradient accumulation (``k`` microsteps) a parameter stored sharded (``S(d)``, FSDP / ZeRO-3)
has its gathered copies' gradients reduce-scattered after every microstep's backward. In the
storage form ``once`` (``passes.sharding.storage_forms``) they are held unreduced over the
microsteps and reduce-scattered once, after the last (torchtitan's deferred reduce-scatter): the
step saves ``(k - 1)`` of each copy's reduce-scatters and holds each copy's gradient (its bytes in
the reduce dtype) from the first microstep's backward to the last's, in the forward and backward of
every microstep.

Which copies a parameter has is the plan's choice of its readers' placements, so the ILP cannot
price ``once`` on its own nodes; this pass decides it on a finished plan instead:
``hold_reductions`` ranks the free sharded parameters with gathered copies by seconds saved per
byte held, and takes them in that order while the held bytes fit under the memory limit beside the
plan's forward and backward peaks (which held gradients raise by exactly their bytes: they are alive
at every position of both, ``peak_timeline``'s ``held_unreduced``; the optimizer step's peak is
unchanged, as they are reduced before it). The plan is then priced again. A parameter whose form is
pinned keeps it.
"""
from __future__ import annotations

from typing import Callable

from autoshard.passes.sharding.storage_forms import holds_copies, with_held_copies
from autoshard.passes.spec import Shard, TensorMeta

__all__ = ["hold_reductions"]


def hold_reductions(solution, captured, pinned: set, limit: float, price: Callable) -> object:
    """``solution`` (a ``Solution`` of ``captured``) with ``once`` on the free parameters it pays for
    (module docstring); ``pinned``: parameter placeholders whose strategy the user fixed; ``price``:
    strategies -> the ``Solution`` evaluated with ``solution``'s levers. Unchanged when nothing fits
    or nothing gains (one microstep: each reduction runs once anyway)."""
    k = solution.levers.accumulation
    if k == 1:
        return solution
    mesh = solution.mesh.shape
    reduce_dtype = _reduce_dtype(solution)
    saved: dict[str, float] = {}
    held: dict[str, float] = {}
    for move in solution.redistributions:
        u = move.producer
        st = solution.strategies.get(u)
        if u not in captured.params or u in pinned or holds_copies(st) or not _sharded(st, mesh):
            continue
        bwd = sum(c.seconds for c in move.collectives if c.phase == "bwd")
        if bwd <= 0:
            continue
        meta: TensorMeta = captured.node(u).meta["autoshard.meta"]
        copy = meta.numel * (reduce_dtype or meta.dtype).itemsize
        for a, p in enumerate(move.dst):
            if isinstance(p, Shard):
                copy /= mesh[a]
        saved[u] = saved.get(u, 0.0) + (k - 1) * bwd
        held[u] = max(held.get(u, 0.0), copy)
    if not saved:
        return solution
    room = limit - max(solution.estimated.get("peak_forward_bytes", solution.estimated_memory),
                       solution.estimated.get("peak_backward_bytes", solution.estimated_memory))
    chosen, used = [], 0.0
    for u in sorted(saved, key=lambda n: (-saved[n] / max(held[n], 1.0), n)):
        if used + held[u] <= room:
            chosen.append(u)
            used += held[u]
    if not chosen:
        return solution
    strategies = dict(solution.strategies)
    for u in chosen:
        strategies[u] = with_held_copies(strategies[u], mesh)
    held_plan = price(strategies)
    if held_plan.estimated_memory > limit or held_plan.estimated_step_time >= solution.estimated_step_time:
        return solution
    held_plan.solver_stats = dict(solution.solver_stats, held_reductions=len(chosen))
    return held_plan


def _sharded(strategy, mesh) -> bool:
    return any(isinstance(p, Shard) and mesh[a] > 1 for a, p in enumerate(strategy.outputs[0]))


def _reduce_dtype(solution):
    mp = solution.levers.mixed_precision
    return None if mp is None else (mp.reduce_dtype or mp.param_dtype)
