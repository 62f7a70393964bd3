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

A parameter's ZeRO axes all take one form (``zero1`` or ``zero2``), and its sharded axes are all
``once`` or all plain; the two choices are independent. The ILP chooses among the plain forms,
``zero1`` and ``zero2``, whose prices are the parameter's own (``passes.cost.storage_prices``); whether
a parameter's gathered copies reduce once per step depends on which copies the plan gathers, so
``passes.solve.held_reductions`` decides ``once`` after the ILP, where memory allows. The
ZeRO axes of a parameter (its ``zero1`` / ``zero2`` axes, ``StorageForm.zero_axes``) split its
optimizer state along one dim, ``zero_dim``: the first dim whose local size the ZeRO axes divide and
that no storage axis after the first ZeRO axis already splits, so the optimizer's slice is a slice of
this rank's stored piece, and ``optimizer_placements`` (the storage with ``S(zero_dim)`` on the ZeRO
axes, DTensor's left-to-right nesting) describes it exactly for checkpoints.

>>> from autoshard.passes.spec import R, S
>>> f = storage_form((S(0), R), ("once", "zero1"), (8, 4096), (2, 2))
>>> f.zero_axes, f.zero_dim, f.zero_once, f.held_copies, optimizer_placements((S(0), R), f)
((1,), 0, True, True, (Shard(dim=0), Shard(dim=0)))
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
           "optimizer_placements", "form_variants", "fmt_storage", "parse_storage", "reduces_once", "holds_copies",
           "with_held_copies"]

ZERO1, ZERO2, ONCE = "zero1", "zero2", "once"
FORMS = (ZERO1, ZERO2, ONCE)


@dataclass(frozen=True)
class StorageForm:
    """A parameter's form, read from its strategy: ``zero_axes`` (mesh axes, size > 1, over which the
    optimizer state is sharded though the parameter is ``R``), ``zero_dim`` (the dim they split; None
    without ZeRO axes), ``zero_once`` (``zero1``: the ZeRO reduce-scatter runs once per step),
    ``held_copies`` (``once``: the gathered copies' gradients are reduced once per step)."""
    zero_axes: tuple[int, ...] = ()
    zero_dim: Optional[int] = None
    zero_once: bool = False
    held_copies: bool = False

    @property
    def zero(self) -> bool:
        return bool(self.zero_axes)

    @property
    def zero_reduced_once(self) -> bool:
        """The ZeRO reduce-scatter runs once per step: ``zero1``, or any ZeRO form whose gradient only
        arrives after the last microstep (its copies' gradients held: ``once``)."""
        return self.zero_once or self.held_copies

    @property
    def plain(self) -> bool:
        return not self.zero_axes and not self.held_copies


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
    zero, kinds, held = [], set(), []
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
            kinds.add(form)
        else:
            held.append(a)
    sharded = [a for a, p in enumerate(storage) if isinstance(p, Shard) and mesh_shape[a] > 1]
    if len(kinds) > 1 or (held and len(held) != len(sharded)):
        raise PlanFormatError(f"storage {fmt_storage(storage, lowerings)}: a parameter's ZeRO axes take one form "
                              "(zero1 or zero2), and its sharded axes are all 'once' or none is")
    d = zero_dim(shape, storage, zero, mesh_shape)
    if zero and d is None:
        raise PlanFormatError(f"storage {fmt_storage(storage, lowerings)} of a parameter of shape {tuple(shape)}: no dim "
                              f"splits over the ZeRO axes {zero}")
    return StorageForm(tuple(zero), d, ZERO1 in kinds, bool(held))


def form_of(strategy: Strategy, shape: Sequence[int], mesh_shape: Sequence[int]) -> StorageForm:
    """``storage_form`` of a parameter placeholder's strategy."""
    lowerings = tuple(strategy.lowerings) or (None,) * len(mesh_shape)
    return storage_form(strategy.outputs[0], lowerings, shape, mesh_shape)


def reduces_once(strategy: Strategy) -> bool:
    """Whether a parameter's strategy reduces something once per step that its twin reduces every
    microstep (``zero1`` against ``zero2``, ``once`` against the plain ``S(d)``)."""
    return any(f in (ZERO1, ONCE) for f in strategy.lowerings)


def holds_copies(strategy: Strategy) -> bool:
    """Whether a parameter's strategy holds its gathered copies' gradients over the microsteps (``once``)."""
    return ONCE in strategy.lowerings


def with_held_copies(strategy: Strategy, mesh_shape: Sequence[int]) -> Strategy:
    """``strategy`` with ``once`` on its sharded axes (size > 1)."""
    lowerings = tuple(strategy.lowerings) or (None,) * len(mesh_shape)
    storage = strategy.outputs[0]
    new = tuple(ONCE if isinstance(p, Shard) and mesh_shape[a] > 1 else f
                for a, (p, f) in enumerate(zip(storage, lowerings)))
    return Strategy(strategy.inputs, strategy.outputs, new)


def optimizer_placements(storage: Sequence, form: StorageForm) -> tuple:
    """Placements of the optimizer's slice (and its reduced gradient): the storage with
    ``S(zero_dim)`` on every ZeRO axis."""
    return tuple(Shard(form.zero_dim) if a in form.zero_axes else p for a, p in enumerate(storage))


def form_variants(shape: Sequence[int], storage: Sequence, mesh_shape: Sequence[int]) -> list[tuple]:
    """Every form a parameter of ``shape`` stored as ``storage`` may take, as ``lowerings`` tuples,
    the plain form first: for every non-empty set of its ``R`` axes (size > 1) with a dim to split,
    ``zero2`` and ``zero1`` there; each of these (and the plain form) also with ``once`` on its sharded
    axes, when it has some."""
    ndim = len(mesh_shape)
    r_axes = [a for a, p in enumerate(storage) if isinstance(p, Replicate) and mesh_shape[a] > 1]
    s_axes = [a for a, p in enumerate(storage) if isinstance(p, Shard) and mesh_shape[a] > 1]
    zeros = [(None,) * ndim]
    for size in range(1, len(r_axes) + 1):
        for axes in itertools.combinations(r_axes, size):
            if zero_dim(shape, storage, axes, mesh_shape) is not None:
                zeros += [tuple(form if a in axes else None for a in range(ndim)) for form in (ZERO2, ZERO1)]
    if not s_axes:
        return zeros
    held = [tuple(ONCE if a in s_axes else f for a, f in enumerate(z)) for z in zeros]
    return [zeros[0], held[0]] + [v for pair in zip(zeros[1:], held[1:]) for v in pair]


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
