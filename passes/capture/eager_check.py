"""Is it the model or the tracer? Run the program once eagerly on the example inputs and see.

When both tracers fail, their messages often blame a tracing limit ("control flow", "a construct the
tracers do not support") for what is the user's mistake: a 0-d timestep where the model asserts a 1-d
one, a keyword argument left out (it arrives as ``None``), an input of the wrong rank. Such a model
raises the same exception when simply called. ``eager_error`` calls the traced program (the model
and, when given, the loss) on the example tensors and returns what it raises, or None when it runs:
then the failure is the tracers' own.

The call leaves no trace: it runs under ``torch.no_grad``, with the random number generators' states
restored afterwards, every buffer's values put back (a BatchNorm in training mode updates its
running statistics) and attributes that forward set removed by the caller's ``_preserved``. On a
meta-device model (planning without memory) an error that only meta tensors raise (``.item()`` on a
meta tensor) says nothing about the model, and ``eager_error`` returns None for it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

__all__ = ["eager_error"]


def _meta_only(error: BaseException, flat: list) -> bool:
    """Whether ``error`` may be an artefact of running on meta tensors rather than the model's own."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
        return False
    text = str(error).lower()  # torch's own words for what a meta tensor cannot do
    return isinstance(error, NotImplementedError) or "meta tensor" in text or "'meta' backend" in text


def eager_error(program: nn.Module, flat: list, *, is_loss_error: Callable[[BaseException], bool]
                ) -> Optional[BaseException]:
    """What ``program(*flat)`` raises when run eagerly (the module docstring's conditions), or None when
    it runs, when only the loss fails (``is_loss_error``: the loss is reported on its own path), or
    when the error may come from meta tensors."""
    buffers = [(b, b.detach().clone()) for b in program.buffers() if not b.is_meta]
    devices = sorted({t.device.index for t in flat if isinstance(t, torch.Tensor) and t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            program(*flat)
    except Exception as e:  # noqa: BLE001 - any exception is the answer
        if is_loss_error(e) or _meta_only(e, flat):
            return None
        return e
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return None
