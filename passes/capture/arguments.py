"""The loss arguments of ``plan`` / ``compile``: ``loss_fn`` and ``example_target`` come as a pair.

The program computes ``loss_fn(output, target)``; given one without the other, tracing would fail deep
inside the loss function (``'NoneType' object has no attribute 'size'``) or silently ignore the target.
``check_loss_arguments`` says which argument is missing and what it needs instead: for a missing target,
the shape of the model's output (traced without the loss), from which the user derives the target's.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["check_loss_arguments"]


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def check_loss_arguments(loss_fn, target, output_shapes: Callable[[], Optional[list]]) -> None:
    """Raise ``TypeError`` when exactly one of ``loss_fn`` and ``target`` is given. ``output_shapes()``
    (called only then) returns the shapes of the model's outputs, or None if they cannot be found."""
    if loss_fn is not None and target is None:
        shapes = output_shapes()
        if shapes:
            out = " and ".join(str(tuple(s)) for s in shapes)
            first = tuple(shapes[0])
            hint = (f"; the model's output has shape {out}, so e.g. F.mse_loss needs a target of shape {first} and "
                    f"F.cross_entropy class indices of shape {first[:-1] or first}")
        else:
            hint = ""
        raise TypeError(f"loss_fn={_name(loss_fn)} was given without example_target: the traced program computes "
                        f"loss_fn(output, target), so pass example_target= one global batch of targets (a tensor)"
                        f"{hint}. For a forward-only (inference) plan, drop loss_fn.")
    if target is not None and loss_fn is None:
        raise TypeError(f"example_target (a tensor of shape {tuple(getattr(target, 'shape', ()))}) was given without "
                        "loss_fn: the target is only read by loss_fn(output, target). Pass loss_fn= (e.g. "
                        "torch.nn.functional.cross_entropy), or drop example_target (a model that computes its own "
                        "loss, like a Hugging Face model given labels, takes them in example_inputs).")
