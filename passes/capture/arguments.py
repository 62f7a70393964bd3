"""The loss arguments of ``plan`` / ``compile``: ``loss_fn`` and ``example_target`` come as a pair.

The program computes ``loss_fn(output, target)``; given one without the other, tracing would fail deep
inside the loss function (``'NoneType' object has no attribute 'size'``) or silently ignore the target.
``check_loss_arguments`` says which argument is missing and what it needs instead: for a missing target,
the shape of the model's output (traced without the loss), from which the user derives the target's.
``check_loss_output`` refuses a ``loss_fn`` that does not return one scalar floating tensor (``None``:
a Hugging Face output's ``.loss`` without labels), which a training step cannot run backward from.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from autoshard.passes.errors import TraceError
from autoshard.passes.graph import META

__all__ = ["check_loss_arguments", "check_loss_output"]


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


def check_loss_output(output: Any, loss_fn: Callable) -> None:
    """Raise ``TraceError`` unless ``output``, what the traced program returns (the output node's
    argument: an fx node, a tuple of them, or None), is one 0-d floating tensor: the loss a step
    runs backward from. The message names what ``loss_fn`` returned instead and the usual cause."""
    meta = getattr(output, "meta", {}).get(META) if output is not None else None
    shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
    if shape == () and dtype is not None and dtype.is_floating_point:
        return
    name = _name(loss_fn)
    if output is None:
        got = "None"
        fix = ("a Hugging Face output's .loss is None when the model is not given labels: pass labels in "
               "example_inputs, or compute the loss from the output (e.g. F.cross_entropy(out.logits.flatten(0, 1), "
               "y.flatten()))")
    elif isinstance(output, (tuple, list)):
        got = f"a {type(output).__name__} of {len(output)} values"
        fix = "return the loss alone (a scalar tensor)"
    elif meta is None:
        got = "a value that is not a tensor"
        fix = "return the loss as a scalar tensor"
    elif shape != ():
        got = f"a tensor of shape {tuple(shape)}"
        fix = "reduce it to a scalar (e.g. .mean(), or reduction='mean')"
    else:
        got = f"a {dtype} scalar"
        fix = "return a floating loss (gradients flow through floating tensors only)"
    raise TraceError(f"loss_fn={name} returned {got}, not a loss: a training step needs one scalar floating tensor "
                     f"to run backward from. Fix: {fix}.")
