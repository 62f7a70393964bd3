"""A mesh axis the batch does not divide, left with nothing to do: a ``BatchError``, not a silent plan.

Data parallelism over a mesh axis needs the batch (dim 0 of the inputs) to divide by the axis'
size: the planner never splits a dim unevenly. When it does not divide, the planner may still use the
axis for tensor or sequence parallelism; but when it finds no such use either, every device of the
axis computes the whole step (``autoshard.verdict.idle_axes``): the plan would train with no speed-up
from that axis. ``check_batch_uses_mesh`` raises ``BatchError`` then, naming the batch, the mesh and
what to change. An axis left idle although the batch divides it is the planner's own finding (no split
pays on this model) and is said by the summary's verdict, not refused.

>>> check_batch_uses_mesh(plan)          # doctest: +SKIP
BatchError: the global batch of 8 (dim 0 of input 'x') does not divide over mesh axis 'axis0' of 3 ...
"""
from __future__ import annotations

from autoshard.passes.errors import BatchError
from autoshard.passes.graph import META
from autoshard.verdict import idle_axes

__all__ = ["check_batch_uses_mesh"]


def _near_multiples(batch: int, size: int) -> str:
    low, high = (batch // size) * size, (batch // size + 1) * size
    return " or ".join(str(b) for b in (low, high) if b > 0)


def _near_meshes(shape: tuple, axis: int, batch: int) -> str:
    """``shape`` with ``axis`` resized to the nearest sizes below and above it that divide ``batch``."""
    divisors = [d for d in range(2, batch + 1) if batch % d == 0]
    near = [d for d in (max((d for d in divisors if d < shape[axis]), default=None),
                        min((d for d in divisors if d > shape[axis]), default=None)) if d is not None]
    return " or ".join(str(tuple(d if a == axis else s for a, s in enumerate(shape))) for d in near)


def _global_batch(plan) -> tuple[int, str]:
    """(global batch, name of the input it was read from) of ``plan``'s captured program: dim 0 of its
    first user input with one, times the accumulation microsteps; (0, "") when it has none."""
    captured = plan.captured
    for name in captured.inputs:
        meta = captured.node(name).meta.get(META)
        if getattr(meta, "shape", ()):
            return int(meta.shape[0]) * plan.solution.levers.accumulation, name
    return 0, ""


def check_batch_uses_mesh(plan) -> None:
    """Raise ``BatchError`` when an axis of ``plan.mesh`` does not divide the global batch and the plan
    splits nothing over it (module docstring). ``plan``: a ``Plan`` with its captured program."""
    if plan.captured is None:
        return
    batch, name = _global_batch(plan)
    if batch <= 0:
        return
    mesh = plan.mesh
    for role in idle_axes(plan.solution, mesh, plan.captured):
        if batch % role.size == 0:
            continue
        meshes = _near_meshes(tuple(mesh.shape), role.axis, batch)
        raise BatchError(
            f"the global batch of {batch} (dim 0 of input {name!r}) does not divide over mesh axis {role.name!r} of "
            f"{role.size} devices (mesh {mesh.shape}), so it cannot be split for data parallelism there, and no other "
            f"split of this model pays on that axis: its {role.size} devices would each compute the whole step, with "
            f"no speed-up. Fix: a global batch divisible by {role.size} (e.g. {_near_multiples(batch, role.size)}), or "
            f"a mesh whose axis divides it" + (f" (e.g. {meshes})" if meshes else "") + "; to use the axis for "
            f"tensor parallelism anyway, pin a split (params=/ops=).")
