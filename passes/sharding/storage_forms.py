"""Parameter storage forms: how a parameter, its gradient and its optimizer state lie over each mesh axis.

A parameter's strategy (a placeholder's ``Strategy``) has one output placement per mesh axis, its
*storage*: ``R`` (every rank holds it whole) or ``S(d)`` (each rank holds a slice). Its
``lowerings`` name, per axis, the *form* of that storage (None: the plain form):

=========  ==========  ===================================================================================
storage    form        what it is
=========  ==========  ===================================================================================
``R``      None        DDP: parameter, gradient and optimizer state whole; the gradient all-reduced once
                       per step (after the last accumulation microstep)
``R``      ``zero1``   ZeRO-1 (Megatron's distributed optimizer): parameter whole for compute, gradient
                       reduce-scattered over the axis once per step, optimizer state and reduced gradient
                       sharded over it; the parameter all-gathered after the optimizer step, once per step
``R``      ``zero2``   ZeRO-2: as ``zero1``, but the gradient is reduce-scattered every microstep, as its
                       bucket fills, and held sharded between microsteps
``S(d)``   None        FSDP / ZeRO-3: each rank stores its slice; the slice is gathered for compute and
                       the copy's gradient reduce-scattered every microstep
``S(d)``   ``once``    FSDP reducing once per step: the gathered copies' gradients are held unsharded over
                       the microsteps and reduce-scattered after the last one
=========  ==========  ===================================================================================

One parameter reduces either once per step or every microstep: ``zero1`` and ``once`` go together
(every ZeRO axis ``zero1`` and every sharded axis ``once``), ``zero2`` with the plain ``S(d)``. The
ZeRO axes of a parameter (its ``zero1`` / ``zero2`` axes, ``StorageForm.zero_axes``) split its
optimizer state along one dim, ``zero_dim``: the first dim whose local size the ZeRO axes divide and
that no storage axis after the first ZeRO axis already splits, so the optimizer's slice is a slice of
this rank's stored piece, and ``optimizer_placements`` (the storage with ``S(zero_dim)`` on the ZeRO
axes, DTensor's left-to-right nesting) describes it exactly for checkpoints.

>>> from autoshard.passes.spec import R, S
>>> f = storage_form((S(0), R), ("once", "zero1"), (8, 4096), (2, 2))
>>> f.zero_axes, f.zero_dim, f.once, optimizer_placements((S(0), R), f)
((1,), 0, True, (Shard(dim=0), Shard(dim=0)))
>>> fmt_storage((S(0), R), ("once", "zero1"))
'(S(0)/once, R/zero1)'

Plain data; the planner (``passes.solve``), the cost model (``passes.cost.storage_prices``) and the
runtime (``runtime.zero``) read forms through this module only.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.spec import Replicate, Shard, Strategy, fmt, parse_placement

__all__ = ["ZERO1", "ZERO2", "ONCE", "FORMS", "StorageForm", "storage_form", "form_of", "zero_dim",
           "optimizer_placements", "form_variants", "fmt_storage", "parse_storage", "reduces_once"]

ZERO1, ZERO2, ONCE = "zero1", "zero2", "once"
FORMS = (ZERO1, ZERO2, ONCE)


@dataclass(frozen=True)
class StorageForm:
    """A parameter's form, read from its strategy: ``zero_axes`` (mesh axes, size > 1, over which the
    optimizer state is sharded though the parameter is ``R``), ``zero_dim`` (the dim they split; None
    without ZeRO axes), ``once`` (every reduction of its gradient runs once per step)."""
    zero_axes: tuple[int, ...] = ()
    zero_dim: Optional[int] = None
    once: bool = False

    @property
    def zero(self) -> bool:
        return bool(self.zero_axes)

    @property
    def plain(self) -> bool:
        return not self.zero_axes and not self.once


PLAIN = StorageForm()


def zero_dim(shape: Sequence[int], storage: Sequence, axes: Sequence[int], mesh_shape: Sequence[int]) -> Optional[int]:
    """The dim the optimizer state of a parameter of ``shape`` stored as ``storage`` is split along over
    the ZeRO ``axes`` (module docstring), or None when no dim allows it."""
    if not axes:
        return None
    n = math.prod(mesh_shape[a] for a in axes)
    local = list(shape)
    for a, p in enumerate(storage):
        if isinstance(p, Shard):
            local[p.dim] //= mesh_shape[a]
    first = min(axes)
    for d in range(len(shape)):
        if any(isinstance(p, Shard) and p.dim == d and a > first for a, p in enumerate(storage)):
            continue  # the ZeRO split would nest outside a storage split: not a slice of the local piece
        if local[d] % n == 0 and local[d] > 0:
            return d
    return None


def storage_form(storage: Sequence, lowerings: Sequence, shape: Sequence[int],
                 mesh_shape: Sequence[int]) -> StorageForm:
    """The form of a parameter stored as ``storage`` with per-axis forms ``lowerings`` (a strategy's);
    ``PlanFormatError`` for a form that cannot hold (a ZeRO form on a sharded axis, mixed timing, no dim
    to split the optimizer state along)."""
    if not any(lowerings):
        return PLAIN
    zero, once_marks, per_step = [], [], []
    for a, (p, form) in enumerate(zip(storage, lowerings)):
        if form is None or mesh_shape[a] == 1:
            continue
        if form not in FORMS:
            raise PlanFormatError(f"storage form {form!r} on axis {a} is unknown; forms are {list(FORMS)}")
        if form in (ZERO1, ZERO2) and not isinstance(p, Replicate):
            raise PlanFormatError(f"storage form {form!r} needs R storage on axis {a}, got {fmt(p)}")
        if form == ONCE and not isinstance(p, Shard):
            raise PlanFormatError(f"storage form 'once' needs S(d) storage on axis {a}, got {fmt(p)}")
        if form in (ZERO1, ZERO2):
            zero.append(a)
        (once_marks if form in (ZERO1, ONCE) else per_step).append(a)
    once = bool(once_marks)
    sharded = [a for a, p in enumerate(storage) if isinstance(p, Shard) and mesh_shape[a] > 1]
    if once and (per_step or any(lowerings[a] != ONCE for a in sharded)):
        raise PlanFormatError(f"storage {fmt_storage(storage, lowerings)}: a parameter reduces its gradient once per "
                              "step on every axis or on none: zero1 goes with S(d)/once, zero2 with plain S(d)")
    d = zero_dim(shape, storage, zero, mesh_shape)
    if zero and d is None:
        raise PlanFormatError(f"storage {fmt_storage(storage, lowerings)} of a parameter of shape {tuple(shape)}: no dim "
                              f"splits over the ZeRO axes {zero}")
    return StorageForm(tuple(zero), d, once)


def form_of(strategy: Strategy, shape: Sequence[int], mesh_shape: Sequence[int]) -> StorageForm:
    """``storage_form`` of a parameter placeholder's strategy."""
    lowerings = tuple(strategy.lowerings) or (None,) * len(mesh_shape)
    return storage_form(strategy.outputs[0], lowerings, shape, mesh_shape)


def reduces_once(strategy: Strategy) -> bool:
    """Whether a parameter's strategy names a form reduced once per step (``zero1`` / ``once``)."""
    return any(f in (ZERO1, ONCE) for f in strategy.lowerings)


def optimizer_placements(storage: Sequence, form: StorageForm) -> tuple:
    """Placements of the optimizer's slice (and its reduced gradient): the storage with
    ``S(zero_dim)`` on every ZeRO axis."""
    return tuple(Shard(form.zero_dim) if a in form.zero_axes else p for a, p in enumerate(storage))


def form_variants(shape: Sequence[int], storage: Sequence, mesh_shape: Sequence[int]) -> list[tuple]:
    """Every form a parameter of ``shape`` stored as ``storage`` may take, as ``lowerings`` tuples,
    the plain form first: for every non-empty set of its ``R`` axes (size > 1) with a dim to split,
    ``zero2`` there (sharded axes plain) and ``zero1`` there (sharded axes ``once``); and, when it has
    sharded axes, ``once`` on them alone."""
    none = (None,) * len(mesh_shape)
    r_axes = [a for a, p in enumerate(storage) if isinstance(p, Replicate) and mesh_shape[a] > 1]
    s_axes = [a for a, p in enumerate(storage) if isinstance(p, Shard) and mesh_shape[a] > 1]
    out = [none]
    if s_axes:
        out.append(tuple(ONCE if a in s_axes else None for a in range(len(mesh_shape))))
    for size in range(1, len(r_axes) + 1):
        for axes in itertools.combinations(r_axes, size):
            if zero_dim(shape, storage, axes, mesh_shape) is None:
                continue
            out.append(tuple(ZERO2 if a in axes else None for a in range(len(mesh_shape))))
            out.append(tuple(ZERO1 if a in axes else ONCE if a in s_axes else None for a in range(len(mesh_shape))))
    return out


def fmt_storage(storage: Sequence, lowerings: Sequence = ()) -> str:
    """``(R/zero1, S(0))``: placements with each axis's form after a slash."""
    lowerings = tuple(lowerings) or (None,) * len(storage)
    return "(" + ", ".join(fmt(p) + (f"/{f}" if f else "") for p, f in zip(storage, lowerings)) + ")"


def parse_storage(text: str) -> tuple:
    """One axis of a parameter pin: ``"R"``, ``"R/zero1"``, ``"S(0)/once"`` -> (placement, form or None)."""
    head, _, form = str(text).partition("/")
    form = form.strip() or None
    if form is not None and form not in FORMS:
        raise ValueError(f"storage form {form!r} in {text!r} is unknown; forms are {list(FORMS)} (e.g. 'R/zero1')")
    return parse_placement(head), form
