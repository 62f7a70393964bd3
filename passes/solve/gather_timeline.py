"""The most gathered parameter copies alive at once in a step, from the order the runtime gathers them.

The runtime (``runtime.param_gather``) gathers parameters one *segment* at a time: a block instance,
or a run of ops between blocks, in program order, each copy made when the first op reading it runs.
A segment's copies are ``kept`` (saved for the backward and held to it), ``transient`` (read in the
forward only, or freed after the forward by reshard-after-forward) and, of the transient ones,
``regathered`` (gathered again for the backward). Copies that are one all-gather of one tensor dim
(``one_dim_gather``: FSDP's case) travel in one flat collective per segment, and that one is
started ahead: the next segment's in the forward (``prefetched``), the previous resharding
segment's re-gather in the backward (``prefetched_again``). Autograd frees a kept copy after its
last backward use, so in the backward only the kept segments up to the current one are alive.

``gathered_peak(segments)``, each a ``Segment`` (bytes), in program order:

    forward at i:  sum(kept j <= i) + transient_i + prefetched_(i+1)
    backward at i: sum(kept j <= i) + regathered_i + prefetched_again_(i-1)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from autoshard.passes.spec import Replicate, Shard

__all__ = ["Segment", "gathered_peak", "one_dim_gather"]


class Segment(NamedTuple):
    kept: float = 0.0
    transient: float = 0.0
    regathered: float = 0.0
    prefetched: float = 0.0
    prefetched_again: float = 0.0


def one_dim_gather(src: Sequence, dst: Sequence) -> bool:
    """Whether moving a parameter from storage ``src`` to ``dst`` (placements per mesh axis) is
    all-gathers of one tensor dim only (the runtime fuses and prefetches those)."""
    dims = set()
    for s, d in zip(src, dst):
        if s == d:
            continue
        if not (isinstance(s, Shard) and isinstance(d, Replicate)):
            return False
        dims.add(s.dim)
    return len(dims) == 1


def gathered_peak(segments: Sequence[Segment]) -> float:
    """See the module docstring."""
    peak, kept_so_far = 0.0, 0.0
    for i, seg in enumerate(segments):
        kept_so_far += seg.kept
        ahead = segments[i + 1].prefetched if i + 1 < len(segments) else 0.0
        behind = segments[i - 1].prefetched_again if i > 0 else 0.0
        peak = max(peak, kept_so_far + seg.transient + ahead, kept_so_far + seg.regathered + behind)
    return peak
