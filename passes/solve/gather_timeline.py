"""The most gathered parameter copies alive at once in a step, from the order the runtime gathers them.

The runtime (``runtime.param_gather``) gathers parameters one *segment* at a time
(``passes.layout.gathers``: a block instance, or a run of ops between blocks), in program order,
each copy made when the first op reading it runs.
A segment's copies are ``kept`` (saved for the backward and held to it), ``transient`` (read in the
forward only, or freed after the forward by reshard-after-forward) and, of the transient ones,
``regathered`` (gathered again for the backward). Copies that are one all-gather of one tensor dim
(``passes.layout.gathers.fused_gather``: FSDP's case) travel in one flat collective per segment, and that one is
started ahead: the next segment's in the forward (``prefetched``), the previous resharding
segment's re-gather in the backward (``prefetched_again``). Autograd frees a kept copy after its
last backward use, so in the backward only the kept segments up to the current one are alive.

``gathered_peak(segments)``, each a ``Segment`` (bytes), in program order:

    forward at i:  sum(kept j <= i) + transient_i + prefetched_(i+1)
    backward at i: sum(kept j <= i) + regathered_i + prefetched_again_(i-1)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Union

from autoshard.passes.graph import CapturedGraph
from autoshard.passes.layout.gathers import SegmentKeys, segment_op
from autoshard.passes.solve.blocks import BlockMap

__all__ = ["Segment", "gathered_peak", "segment_of"]


class Segment(NamedTuple):
    kept: float = 0.0
    transient: float = 0.0
    regathered: float = 0.0
    prefetched: float = 0.0
    prefetched_again: float = 0.0


def gathered_peak(segments: Sequence[Segment]) -> float:
    """See the module docstring."""
    peak, kept_so_far = 0.0, 0.0
    for i, seg in enumerate(segments):
        kept_so_far += seg.kept
        ahead = segments[i + 1].prefetched if i + 1 < len(segments) else 0.0
        behind = segments[i - 1].prefetched_again if i > 0 else 0.0
        peak = max(peak, kept_so_far + seg.transient + ahead, kept_so_far + seg.regathered + behind)
    return peak


def segment_of(captured: CapturedGraph, blocks: BlockMap) -> dict[str, Union[str, int]]:
    """Every op's gather segment (``passes.layout.gathers.SegmentKeys``, as the runtime groups copies)."""
    keys = SegmentKeys()
    return {n.name: keys.key(blocks.instance.get(n.name)) for n in captured.gm.graph.nodes if segment_op(n)}
