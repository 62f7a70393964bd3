"""Keep torch's ``MemTracker`` from holding gradients a real step frees.

``MemTracker`` follows modules with ``ModTracker``, whose forward pre-hook registers
``torch.autograd.graph.register_multi_grad_hook(inputs, ..., mode="all")`` on every module input that
requires grad. In "all" mode that hook keeps each input's gradient in a buffer until every input's
gradient has arrived (``graph.py``: ``buffer[id][idx] = grad``). A compiled program's GraphModule
takes the parameters as inputs, so every parameter gradient is then held until the module's whole
backward is done; and because a second reference exists when it reaches ``AccumulateGrad``, autograd
cannot steal it into ``.grad`` and clones it (``accumulate_grad.h``: the steal needs
``use_count() <= num_expected_refs``). Every parameter gradient is then alive twice to the end of the
backward under the tracker, and once without it.

Measured (2026-11-27, issue 27) on the 7.3 M-parameter Llama of ``heldout_models`` on (4,), full
checkpoint + reshard: ``MemTracker`` 135.5 MB; the process's heap (glibc's mmapped chunks, every
allocation of 64 KiB or more, ``heap_probe``) 117.6 MB; with the hook below, ``MemTracker`` agrees with
the heap. An eager ``nn.Module`` whose parameters are attributes, not inputs, never meets this.

``gradients_not_held()`` swaps ModTracker's hook, for its duration, for one with the same "all"
semantics (the callback runs once every input's gradient has arrived, in the same graph task) that
counts arrivals instead of keeping the gradients; ModTracker's callbacks ignore the gradients they are
given. "any" hooks pass through unchanged.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc
from torch.distributed._tools import mod_tracker
from torch.utils.hooks import RemovableHandle

__all__ = ["gradients_not_held", "counting_multi_grad_hook"]


class _Handles:
    def __init__(self, handles: tuple[RemovableHandle, ...]):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def counting_multi_grad_hook(tensors, fn, *, mode: str = "all", _original=None):
    """``register_multi_grad_hook`` that keeps no gradient: in "all" mode ``fn`` gets a list of
    ``None`` once every tensor that the running backward reaches has had its gradient computed."""
    if mode != "all":
        return (_original or torch.autograd.graph.register_multi_grad_hook)(tensors, fn, mode=mode)
    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    arrived: dict[int, int] = {}
    expected: dict[int, int] = {}
    lock = threading.Lock()

    def inner(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in expected:
                expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
            arrived[task] = arrived.get(task, 0) + 1
            done = arrived[task] == expected[task]
            if done:
                del arrived[task], expected[task]
        if done:
            fn([None] * len(tensors))

    return _Handles(tuple(t.register_hook(inner) for t in tensors))


@contextlib.contextmanager
def gradients_not_held():
    """ModTracker registers ``counting_multi_grad_hook`` instead of torch's buffering one (module docstring)."""
    original = mod_tracker.register_multi_grad_hook

    def hook(tensors, fn, *, mode="all"):
        return counting_multi_grad_hook(tensors, fn, mode=mode, _original=original)

    mod_tracker.register_multi_grad_hook = hook
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
