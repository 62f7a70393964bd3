"""Keep torch's ``MemTracker`` from holding gradients a real step frees.

``MemTracker`` follows modules with ``ModTracker``, whose forward pre-hook registers
``torch.autograd.graph.register_multi_grad_hook(inputs, ..., mode="all")`` on every module input that
requires grad. In "all" mode that hook keeps each input's gradient in a buffer until every input's
gradient has arrived (``graph.py``: ``buffer[id][idx] = grad``). A compiled program's GraphModule
takes the parameters as inputs, so every parameter gradient is then held until the module's whole
backward is done; and because a second reference exists when it reaches ``AccumulateGrad``, autograd
cannot steal it into ``.grad`` and clones it (``accumulate_grad.h``: the steal needs
``use_count() <= num_expected_refs``). Every parameter gradient is then alive twice to the end of the
backward under the tracker, and once without it. The hooks stay registered on the parameters after
the tracker exits, so every later step of the program holds its gradients too.

Measured (2026-11-27, issue 27) on the 7.3 M-parameter Llama of ``heldout_models`` on (4,), full
checkpoint + reshard: ``MemTracker`` 135.5 MB; the process's heap (glibc's mmapped chunks, every
allocation of 64 KiB or more, ``heap_probe``) 117.6 MB; with the hook below, ``MemTracker`` 118.5 MB.
An eager ``nn.Module`` whose parameters are attributes, not inputs, never meets this.

``gradients_not_held(mod_tracker)``: while it is on, that ``ModTracker``'s forward pre-hook registers
its "all" hook on the module's non-leaf inputs only (activations; a parameter's gradient, a leaf's,
goes straight to ``AccumulateGrad``). A module whose differentiable inputs are all leaves is marked
done at the end of the backward, as ModTracker marks a module without differentiable inputs. Only the
module tracking's timing changes (which module the backward is in); no gradient is held.
"""
from __future__ import annotations

import contextlib

from torch.distributed._tools import mod_tracker

__all__ = ["gradients_not_held"]


@contextlib.contextmanager
def gradients_not_held(tracker: "mod_tracker.ModTracker"):
    """See the module docstring; ``tracker``: the ``ModTracker`` whose hooks are registered meanwhile."""
    original = mod_tracker.register_multi_grad_hook

    def hook(tensors, fn, *, mode="all"):
        if mode != "all":
            return original(tensors, fn, mode=mode)
        inner = [t for t in tensors if t.grad_fn is not None]
        if inner:
            return original(inner, fn, mode=mode)
        tracker._post_bw_callbacks_to_enqueue.append(fn)
        return None

    mod_tracker.register_multi_grad_hook = hook
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
