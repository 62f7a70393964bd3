"""A step's inputs cut into the microbatches the program runs, checked against the traced shapes.

A rank program is traced at ONE microbatch: the global batch / (accumulation rounds x pipeline
microbatches). ``StepInputs.cut`` takes the global batch (the same full tensors on every rank), or
with ``local_batch`` this rank's data-parallel slice of it (``local_batch``), checks every input and
the target against the traced shapes, moves them to the device, casts floating inputs to the traced
dtype under mixed precision, and cuts each along dim 0 into ``n`` microbatches: microbatch i holds
rows ``[i * b, (i + 1) * b)``. Inputs that are not tensors (traced as constants) go to every
microbatch as they are.
"""
from __future__ import annotations

from typing import Optional

import torch

from autoshard.passes.errors import BatchError
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.spec import TensorMeta

__all__ = ["StepInputs"]


class StepInputs:
    """The inputs of ``captured`` (traced at one of ``n`` microbatches) for one step on ``device``;
    ``cast``: floating inputs take the traced dtype (mixed precision)."""

    def __init__(self, captured: CapturedGraph, n: int, device: torch.device, cast: bool = False):
        self.captured, self.n, self.device, self.cast = captured, int(n), device, cast
        names = list(captured.inputs) + ([captured.target] if captured.target is not None else [])
        self.entries = [(name, captured.node(name).meta.get(META)) for name in names]

    def global_shape(self, shape) -> tuple:
        """The global batch's shape of an input traced at ``shape`` (one microbatch)."""
        return tuple(shape) if self.n == 1 or not shape else (shape[0] * self.n,) + tuple(shape[1:])

    def _hint(self, meta) -> str:
        return f" (microbatch {meta.shape} x {self.n} microbatches)" if self.n > 1 else ""

    def cut(self, inputs: tuple, target, shapes: Optional[dict] = None, where: str = "") -> tuple[list, list]:
        """(per user input, its ``n`` microbatches; the target's ``n`` microbatches, or ``[None] * n``).
        ``shapes``: the shape each input must have (this rank's slice, ``local_batch``); ``where`` says
        which slice in errors."""
        has_target = self.captured.target is not None
        user = self.entries[:len(self.entries) - has_target]
        if len(inputs) != len(user):
            raise BatchError(f"the program was traced with {len(user)} input(s) {[n for n, _ in user]} "
                             f"but got {len(inputs)}")
        if has_target and target is None:
            meta = self.entries[-1][1]
            shape = getattr(meta, "shape", None)
            raise BatchError(f"the program was traced with a loss: pass target= (the full global target of "
                             f"shape {self.global_shape(shape) if shape else '?'})")
        if not has_target and target is not None:
            raise BatchError("the program was traced without a loss function; call it without target=")
        values = tuple(inputs) + ((target,) if has_target else ())
        cut = [self._cut(name, meta, x, shapes, where) for (name, meta), x in zip(self.entries, values)]
        if has_target:
            return cut[:-1], cut[-1]
        return cut, [None] * self.n

    def _cut(self, name: str, meta, x, shapes: Optional[dict], where: str) -> list:
        if not isinstance(meta, TensorMeta):
            return [x] * self.n
        if not isinstance(x, torch.Tensor):
            raise BatchError(f"input {name!r} must be a tensor of shape {self.global_shape(meta.shape)}, "
                             f"got {type(x).__name__}")
        if shapes is not None and tuple(x.shape) != shapes[name]:
            raise BatchError(f"input {name!r} has shape {tuple(x.shape)}; with local_batch=True this rank passes "
                             f"its slice of the global batch {self.global_shape(meta.shape)}: shape {shapes[name]}"
                             f"{where}")
        if shapes is None and tuple(x.shape) != self.global_shape(meta.shape):
            raise BatchError(f"input {name!r} has shape {tuple(x.shape)} but the program was traced with the "
                             f"global batch {self.global_shape(meta.shape)}" + self._hint(meta)
                             + "; pass the full global batch of the traced shape on every rank, or only this "
                               "rank's slice with local_batch=True (or compile again for a new shape)")
        if x.device != self.device:
            x = x.to(self.device, non_blocking=True)
        if self.cast and x.is_floating_point() and meta.dtype.is_floating_point and x.dtype != meta.dtype:
            x = x.to(meta.dtype)
        if self.n == 1:
            return [x]
        b = x.shape[0] // self.n
        return [x.narrow(0, i * b, b) for i in range(self.n)]
