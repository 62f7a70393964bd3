"""``local_module(program)``: this rank's parameter shards and buffers as an ``nn.Module``.

torch's memory tools take stateful objects (modules, optimizers, tensors): ``MemTracker.track_external``
refuses anything else. A compiled program's state lives in plain lists (``RankProgram``), so this
module holds the *same* tensors (no copies) as registered parameters and buffers, named after the
model's own names (dots replaced by ``__``, as a ``nn.Module`` attribute name cannot hold a dot)::

    from torch.distributed._tools.mem_tracker import MemTracker
    mt = MemTracker()
    mt.track_external(cm.local_module, optimizer)     # parameters, their gradients, optimizer state
    with mt:
        cm.step(x, target=y); optimizer.step()
    mt.get_tracker_snapshot("peak")                   # {device: {"Parameter": ..., "Total": ...}}

It also holds, as non-persistent buffers ``grad_bucket_<i>``, the flat gradient all-reduce buckets
``runtime.gradsync`` allocates once and keeps (after a step, each synced gradient is a view into one):
memory the step holds from its first op, which a tracker would otherwise see only when the backward
first writes into a bucket.

``cm.local_module`` is built once per ``CompiledModel``; it has no ``forward`` (it is a view of the
state for tools, not a way to run the model). With gradient accumulation the step calls the
program's GraphModule once per microstep and ``MemTracker`` refuses a root module's second call
("multiple iterative calls"): ``autoshard.testing.memory_estimates.MicrostepTracker`` is a
``MemTracker`` that clears its per-module statistics between microsteps (the peak is kept).
"""
from __future__ import annotations

import torch.nn as nn

__all__ = ["LocalState", "local_module", "GRAD_BUCKET_PREFIX"]

#: name prefix of the gradient all-reduce buckets registered as (non-persistent) buffers: the runtime
#: allocates them once and holds them for the whole step, so a memory tool must count them from the start
GRAD_BUCKET_PREFIX = "grad_bucket_"


class LocalState(nn.Module):
    """The rank's parameter shards and buffers, registered under ``fqn.replace(".", "__")``."""

    def forward(self, *args, **kwargs):
        raise TypeError("LocalState only holds a compiled program's local tensors for memory tools; run the "
                        "step with CompiledModel.step")


def local_module(program) -> LocalState:
    """A ``LocalState`` over ``program``'s (a ``RankProgram``) live parameters and buffers."""
    module = LocalState()
    for fqn, param in program.named_parameters():
        module.register_parameter(fqn.replace(".", "__"), param)
    for fqn, buf in program.named_buffers():
        module.register_buffer(fqn.replace(".", "__"), buf)
    syncs = getattr(program, "_syncs", None) or {}  # a RankProgram's GradSync per stage (runtime/gradsync.py)
    flats = [flat for sync in syncs.values() for flat in sync.flat_buffers()]
    for i, flat in enumerate(flats):
        module.register_buffer(f"{GRAD_BUCKET_PREFIX}{i}", flat, persistent=False)
    return module
