"""Parameter gathers priced as the runtime runs them: one flat collective per fused set.

The cost model prices each parameter's move from its storage to what an op needs on its own: one
all-gather per mesh axis forward, one reduce-scatter per axis backward, each paying the
collective's fixed cost (latency and launch). The runtime (``runtime.param_gather``) gathers the
copies of one segment (``passes.layout.gathers``: a block instance, or the ops between blocks)
whose steps are all-gathers of one dim (``fused_gather``) in ONE flat collective per (mesh axes,
dtype) -- the shards concatenated, gathered over the axes flattened -- and reduce-scatters their
gradients the same way. On a backend whose calls cost milliseconds of latency (gloo on CPU: an
FSDP step of the 2-layer GPT ran 4 flat gathers where 14 were priced), pricing per parameter
overstates the step.

``fused_gather_copies(cm, moves, again)`` prices the copies around those flat calls, which the
collective's own price leaves out: the runtime copies the shards into the flat input (``torch.cat``),
the gathered flat output into each parameter's copy (``torch.split_with_sizes_copy``), the copies'
gradients into the flat reduce-scatter input (``torch.cat`` with the cast to the reduce dtype) and the
reduced flat shard back into each gradient (``runtime/param_gather.py``), as FSDP2 does
(torch/distributed/_composable/fsdp/_fsdp_collectives.py: ``foreach_all_gather``'s
``torch._foreach_copy_`` into the all-gather input, ``foreach_all_gather_copy_out``'s
``split_with_sizes_copy``, ``foreach_reduce``'s ``_chunk_cat`` copy-in with the reduce-dtype cast, the
reduce-scatter output viewed and divided in place into the sharded gradient). Each copy reads and
writes its bytes at the copy kernel class's rate (``passes/cost/kernel_classes.py``); a copy gathered
again for the backward (reshard after forward) pays its forward copies twice.

``fused_gather_correction(cm, groups)`` gives, per phase, the seconds to take off the per-parameter
price: what the members' own collectives were priced at, less one flat collective of their summed
bytes (``CostModel.flat_collective_time``) plus one op launch. The ILP keeps the per-parameter
price (an upper bound, as for shared copies); ``solution.evaluate`` applies the correction.

>>> from autoshard.passes.cost.collectives import Collective
>>> class Flat:                       # 1 ms per call plus 1 us per byte, no launch cost
...     hardware = type("H", (), {"op_overhead_s": 0.0})()
...     def flat_collective_time(self, kind, axes, nbytes): return 1e-3 + 1e-6 * nbytes
>>> one = lambda b: (Collective("all_gather", 0, b, 1e-3 + 1e-6 * b), Collective("reduce_scatter", 0, b, 1e-3 + 1e-6 * b, "bwd"))
>>> fwd, bwd = fused_gather_correction(Flat(), [[((0,), "f32", one(100)), ((0,), "f32", one(300))]])
>>> round(fwd, 9), round(bwd, 9)     # two calls priced, one runs: one fixed cost less each way
(0.001, 0.001)
"""
from __future__ import annotations

from typing import Iterable, Sequence

from autoshard.passes.cost.collectives import Collective

__all__ = ["fused_gather_correction", "fused_gather_copies"]

_FLAT_KIND = {"fwd": "all_gather", "bwd": "reduce_scatter"}


def fused_gather_correction(cm, groups: Iterable[Sequence[tuple]]) -> tuple[float, float]:
    """(forward, backward) seconds the per-parameter price of fused gathers exceeds the runtime's
    flat collectives by. ``groups``: the gather groups in the runtime's order
    (``passes.layout.gathers.gather_groups``), each a list of ``(axes, dtype, collectives)`` for
    its fused members: the mesh axes of the flat gather, the copy's dtype and the collectives the
    member's move was priced with (forward all-gathers, backward reduce-scatters)."""
    saved = {"fwd": 0.0, "bwd": 0.0}
    for members in groups:
        sets: dict[tuple, list[tuple[Collective, ...]]] = {}
        for axes, dtype, colls in members:
            sets.setdefault((tuple(axes), str(dtype)), []).append(tuple(colls))
        for (axes, _), moves in sets.items():
            for phase, kind in _FLAT_KIND.items():
                per_member = [[c for c in colls if c.phase == phase] for colls in moves]
                per_member = [cs for cs in per_member if cs]
                if not per_member:
                    continue
                priced = sum(c.seconds for cs in per_member for c in cs)
                nbytes = sum(max(c.bytes for c in cs) for cs in per_member)  # the last step moves the whole copy
                flat = cm.flat_collective_time(kind, axes, nbytes) + cm.hardware.op_overhead_s
                saved[phase] += priced - flat
    return saved["fwd"], saved["bwd"]


def fused_gather_copies(cm, moves: Iterable[tuple], again=lambda key: False) -> tuple[float, float]:
    """(forward, backward) seconds of the memory-bound copies around the flat gathers and reduce-scatters
    (module docstring). ``moves``: ``(key, axes, collectives)`` per fused copy (its flat gather's mesh
    axes and what its move was priced with); ``again(key)``: the copy is gathered again in the
    backward. A copy's all-gather of B bytes over n ranks copies B / n in and B out; its reduce-scatter
    of G bytes (the reduce dtype's) reads B and writes G in, and copies G / n out."""
    from autoshard.passes.cost.kernel_classes import class_seconds
    hw = cm.hardware
    fwd = bwd = 0.0
    for key, axes, colls in moves:
        n = 1
        for a in axes:
            n *= cm.mesh.shape[a]
        gathered = max((c.bytes for c in colls if c.phase == "fwd"), default=0)
        reduced = max((c.bytes for c in colls if c.phase == "bwd"), default=0)
        gather = class_seconds(hw, "copy", 2 * gathered / n + 2 * gathered) if gathered else 0.0
        fwd += gather
        bwd += gather if again(key) else 0.0
        if reduced:
            bwd += class_seconds(hw, "copy", gathered + reduced + 2 * reduced / n)
    return fwd, bwd
