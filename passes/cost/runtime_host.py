"""What the runtime does around a collective besides communicating: layout copies and op dispatches.

The profile's collective fits (``passes/cost/profile_format.py``) time a bare ``torch.distributed``
call on a contiguous 1-d buffer. The per-rank program calls ``runtime.collectives`` instead, whose
raw steps arrange the tensor for the call and back (``_gather``, ``_scatter_sum``, ``_sum``,
``_exchange``), read in that file:

========================  ============================================  =====================================
step                      ops dispatched besides the call               bytes copied (local)
========================  ============================================  =====================================
all_gather, dim 0         ``new_empty``                                 none
all_gather, dim d > 0     ``movedim``, ``contiguous``, ``new_empty``,   its input (B / n) and output (B)
                          ``movedim``, ``contiguous``
reduce_scatter, dim 0     ``new_empty``                                 none
reduce_scatter, dim d     as all_gather's                               its input (B) and output (B / n)
all_reduce                ``clone``                                     B (the call reduces a new tensor)
all_to_all                ``unflatten``, ``movedim``, ``contiguous``,   its input and output (B / n each)
                          ``empty_like``, ``movedim``, ``flatten``,
                          ``contiguous``
========================  ============================================  =====================================

A backward step is its forward's adjoint, with the adjoint's own row (all_gather's backward is a
reduce_scatter over the same dim). Each dispatch costs the hardware's ``op_overhead_s`` (the cost
model counts a view as a dispatch too, as ``GraphFacts`` does); each copy reads and writes its bytes
at the memory bandwidth the model prices elementwise ops with (``memory_bandwidth`` times
``memory_efficiency``). On GPU presets ``op_overhead_s`` is 0 (launches are asynchronous) and the copies
cost microseconds; on a CPU, where the profile measures some 45 us per op with 4 ranks on 2 cores, a
step adds a few tenths of a millisecond. ``tests/runtime/test_runtime_host.py`` checks the table
against the ops the runtime dispatches.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["step_host", "step_host_seconds"]

#: (dispatches besides the call, copy bytes as multiples of (input, output) local bytes) per kind,
#: for a step on dim 0 and on a later dim
_ROWS = {
    ("all_gather", True): (1, 0.0, 0.0), ("all_gather", False): (5, 1.0, 1.0),
    ("reduce_scatter", True): (1, 0.0, 0.0), ("reduce_scatter", False): (5, 1.0, 1.0),
    ("all_reduce", True): (1, 1.0, 0.0), ("all_reduce", False): (1, 1.0, 0.0),
    ("all_to_all", True): (7, 1.0, 1.0), ("all_to_all", False): (7, 1.0, 1.0),
}


def step_host(kind: str, dim: Optional[int], group_bytes: float, n: int) -> tuple[int, float]:
    """(ops dispatched besides the call, bytes copied) of one runtime collective step of ``kind``
    over ``n`` ranks on tensor dim ``dim`` (None: unknown, priced as dim 0), with the full per-group
    bytes ``group_bytes`` (B of ``passes/cost/collectives.py``).

    >>> step_host("all_gather", 1, 4096, 4)      # in: 1024 B, out: 4096 B
    (5, 5120.0)
    """
    row = _ROWS.get((kind, not dim))
    if row is None:
        return 0, 0.0
    ops, in_copies, out_copies = row
    local_in = {"all_gather": group_bytes / n, "reduce_scatter": group_bytes, "all_reduce": group_bytes,
                "all_to_all": group_bytes / n}[kind]
    local_out = {"all_gather": group_bytes, "reduce_scatter": group_bytes / n, "all_reduce": group_bytes,
                 "all_to_all": group_bytes / n}[kind]
    return ops, in_copies * local_in + out_copies * local_out


def step_host_seconds(hardware, kind: str, dim: Optional[int], group_bytes: float, n: int) -> float:
    """Seconds ``step_host``'s dispatches and copies take on ``hardware``."""
    ops, copied = step_host(kind, dim, group_bytes, n)
    bandwidth = hardware.memory_bandwidth * hardware.memory_efficiency
    return ops * hardware.op_overhead_s + 2.0 * copied / bandwidth
