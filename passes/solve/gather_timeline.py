"""The most gathered parameter copies alive at once in a step, from the order the runtime gathers them.

The runtime (``runtime.param_gather``) gathers parameters one *segment* at a time: a block instance,
or a run of ops between blocks, in program order, each copy made when the first op reading it runs.
A segment's copies are ``kept`` (saved for the backward and held to it), ``transient`` (read in the
forward only, or freed after the forward by reshard-after-forward) and, of the transient ones,
``regathered`` (gathered again for the backward). The next segment's gather is started ahead in the
forward, and the previous segment's re-gather ahead in the backward, so around each segment the
next one is in flight too. Autograd frees a kept copy after its last backward use, so in the
backward only the kept segments up to the current one are alive.

``gathered_peak(segments)``, ``segments`` = ``[(kept, transient, regathered), ...]`` (bytes, program
order):

    forward at i:  sum(kept j <= i) + transient_i + kept_(i+1) + transient_(i+1)
    backward at i: sum(kept j <= i) + regathered_i + regathered_(i-1)
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["gathered_peak"]


def gathered_peak(segments: Sequence[tuple[float, float, float]]) -> float:
    """See the module docstring."""
    peak, kept_so_far = 0.0, 0.0
    for i, (kept, transient, regathered) in enumerate(segments):
        kept_so_far += kept
        ahead = sum(segments[i + 1][:2]) if i + 1 < len(segments) else 0.0
        behind = segments[i - 1][2] if i > 0 else 0.0
        peak = max(peak, kept_so_far + transient + ahead, kept_so_far + regathered + behind)
    return peak
