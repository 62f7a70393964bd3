"""Collective formulas: seconds for one collective over one mesh axis, flat or across nodes.

Collectives over one mesh axis of ``n`` devices with link bandwidth ``bw`` (bytes/s per direction)
and per-step latency ``lat``; ``B`` is always the FULL per-group bytes (the gathered tensor for an
all-gather, the input of a reduce-scatter, the tensor each rank holds for an all-reduce, the sum of
all ranks' pieces for an all-to-all); every call also pays ``hardware.collective_launch_s``:

    all_reduce      2 (n-1)/n   * B / bw  +  2 (n-1) * lat     (ring: reduce-scatter + all-gather)
    all_gather        (n-1)/n   * B / bw  +    (n-1) * lat
    reduce_scatter    (n-1)/n   * B / bw  +    (n-1) * lat
    all_to_all        (n-1)/n^2 * B / bw  +    (n-1) * lat     (each rank keeps 1/n of its B/n piece)

>>> round(collective_seconds("all_reduce", 8e9, 4, 100e9, 0.0), 4)   # 2 * 3/4 * 8 GB / 100 GB/s
0.12

All-reduce has a second algorithm, ``algorithm="tree"`` (a pipelined double binary tree: reduce up,
broadcast down; Sanders, Speck & Traeff 2009, used by NCCL since 2.4): ``2 ceil(log2 n) * lat +
2 B / bw`` -- fewer latency steps, more bytes per link; ``"auto"`` takes the cheaper per call.
Point-to-point (``p2p_seconds``): ``lat + B / bw``.

An axis that crosses nodes with ``g`` members per node and ``m`` nodes (``Hardware.axis_locality``)
is priced hierarchically, as rail-aligned two-level collectives (Horovod's / NCCL's hierarchical
all-reduce): all-reduce = reduce-scatter inside the node (B) + all-reduce across nodes (B/g) +
all-gather inside the node (B); all-gather = across nodes (B/g) then inside (B); reduce-scatter
the mirror; all-to-all sends its (g-1)/n^2 B local pieces over the intra link and (n-g)/n^2 B over
the inter link. ``CostModel(..., hierarchical=False)`` prices the whole axis flat at the inter-node
link instead (for comparison). A collective a measured profile has a fit for (kind, n, intra-node
group) costs ``latency_s + seconds_per_byte * B`` from the fit instead of the formula.

Which collectives a redistribution runs is ``passes.layout.redistribution`` (``redistribution_steps``),
the steps the runtime executes: pricing the same steps keeps the plan's collectives equal to the
program's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

__all__ = ["Collective", "axis_label", "collective_seconds", "collective_terms", "hierarchical_terms", "p2p_seconds"]


@dataclass(frozen=True)
class Collective:
    """One collective a plan inserts: ``kind`` over mesh axis ``axis`` moving ``bytes`` (the full
    per-group bytes B), taking ``seconds``; ``phase`` is "fwd" or "bwd" (the backward adjoint).
    ``axis`` is a tuple of mesh axes when the collective runs over them flattened into one group
    (a parameter's FSDP gather over every axis it is sharded on: ``passes.layout.gathers.fused_gather``)."""
    kind: str
    axis: Union[int, tuple[int, ...]]
    bytes: int
    seconds: float
    phase: str = "fwd"

    def to_json(self) -> dict:
        axis = self.axis if isinstance(self.axis, int) else list(self.axis)
        return {"kind": self.kind, "axis": axis, "bytes": self.bytes, "seconds": self.seconds, "phase": self.phase}

    @classmethod
    def from_json(cls, d: dict) -> "Collective":
        axis = d["axis"]
        axis = tuple(int(a) for a in axis) if isinstance(axis, (list, tuple)) else int(axis)
        return cls(str(d["kind"]), axis, int(d["bytes"]), float(d["seconds"]), str(d.get("phase", "fwd")))


def axis_label(axis: Union[int, tuple[int, ...]], axis_names) -> str:
    """A collective's mesh axis by name; axes flattened into one group join with "*".

    >>> axis_label((0, 1), ("dp", "tp"))
    'dp*tp'
    """
    return axis_names[axis] if isinstance(axis, int) else "*".join(axis_names[a] for a in axis)


_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def collective_terms(kind: str, n: int, bandwidth: float, latency: float, algorithm: str = "ring") -> tuple[float, float]:
    """(fixed seconds, seconds per byte of B) of one flat ``kind`` collective over ``n`` devices.

    >>> [round(t, 15) for t in collective_terms("all_gather", 4, 1e9, 1e-5)]  # 3 latency steps, 3/4 of B
    [3e-05, 7.5e-10]
    """
    if n <= 1:
        return 0.0, 0.0
    if kind not in _STEPS:
        raise ValueError(f"unknown collective {kind!r}: one of {sorted(_STEPS)}")
    if kind == "all_reduce" and algorithm == "tree":
        return 2.0 * math.ceil(math.log2(n)) * latency, 2.0 / bandwidth
    volume = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n ** 2}[kind]
    return _STEPS[kind] * (n - 1) * latency, volume / bandwidth


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, latency: float,
                       launch: float = 0.0, algorithm: str = "ring") -> float:
    """Time of one ``kind`` collective over ``n`` devices; ``nbytes`` is the full per-group B.

    ``algorithm`` (all-reduce only): "ring", "tree", or "auto" (the cheaper of the two)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce" and algorithm == "auto":
        return min(collective_seconds(kind, nbytes, n, bandwidth, latency, launch, a) for a in ("ring", "tree"))
    fixed, per_byte = collective_terms(kind, n, bandwidth, latency, algorithm)
    return fixed + per_byte * nbytes + launch


def hierarchical_terms(kind: str, g: int, m: int, intra: tuple[float, float], inter: tuple[float, float],
                       algorithm: str = "ring") -> tuple[float, float]:
    """(fixed seconds, seconds per byte of B) of a two-level ``kind`` over ``g`` members per node
    times ``m`` nodes; ``intra`` and ``inter`` are (bandwidth, latency) of the two links."""
    n = g * m
    if kind == "all_to_all":
        return (g - 1) * intra[1] + (n - g) * inter[1], (g - 1) / n ** 2 / intra[0] + (n - g) / n ** 2 / inter[0]

    def flat(k, size, link, scale):
        fixed, per_byte = collective_terms(k, size, link[0], link[1], algorithm)
        return fixed, per_byte * scale

    if kind == "all_reduce":
        parts = [flat("reduce_scatter", g, intra, 1.0), flat("all_reduce", m, inter, 1.0 / g),
                 flat("all_gather", g, intra, 1.0)]
    elif kind == "all_gather":
        parts = [flat("all_gather", m, inter, 1.0 / g), flat("all_gather", g, intra, 1.0)]
    elif kind == "reduce_scatter":
        parts = [flat("reduce_scatter", g, intra, 1.0), flat("reduce_scatter", m, inter, 1.0 / g)]
    else:
        raise ValueError(f"unknown collective {kind!r}: one of {sorted(_STEPS)}")
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def p2p_seconds(nbytes: float, bandwidth: float, latency: float, launch: float = 0.0) -> float:
    """One point-to-point message of ``nbytes``: ``latency + nbytes / bandwidth (+ launch)``.

    >>> p2p_seconds(1e6, 1e9, 1e-5)
    0.00101
    """
    return latency + nbytes / bandwidth + launch
