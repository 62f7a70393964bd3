"""Collectives as NCCL runs them: per algorithm and protocol, the latency and bandwidth NCCL's own
tuner assumes, on the hardware's achievable bus bandwidths.

NCCL picks, per call, the (algorithm, protocol) pair its cost model says is fastest
(``src/graph/tuning.cc``, ``ncclTopoTuneModel``): ``time = latency + bytes / algbw``. This module
reproduces that model for the collectives autoshard inserts, so the cost model's ``min`` over the
candidates returned here is NCCL's choice:

- **ring** (every collective), protocols Simple, LL128 and LL. ``algbw = busbw * n / nsteps`` with
  ``nsteps = 2 (n-1)`` for all-reduce and ``n - 1`` for all-gather / reduce-scatter (nccl-tests
  PERFORMANCE.md: ``busbw = algbw * 2 (n-1)/n`` resp. ``(n-1)/n``); in the formulas of this project
  (``B`` = full per-group bytes) that is ``B * 2 (n-1)/n / busbw`` resp. ``B (n-1)/n / busbw``.
  Latency ``baseLat + (nsteps - nInter) * intraLat + nInter * interLat``.
- **tree** (all-reduce only): ``algbw = 0.5 * 0.92 * busbw``, latency ``baseLat + 2 ((g-1) intraLat
  + log2(m) interLat)``: fewer latency steps for small messages across many nodes.
- **NVLS** (all-reduce inside one NVSwitch node with NVLink SHARP, ``hardware.nvls_bus_factor`` x
  the NVLink bus bandwidth):
  the switch reduces; latency the NVLS hardware latency.
- protocols: LL moves 8-byte flag+data words (busbw / 4, capped), LL128 128-byte lines (0.92 x busbw),
  Simple the whole bandwidth with the longest latency: the small-message regime comes from here.

Bus bandwidth of a group of ``g`` members per node over ``m`` nodes: inside a node the NVLink bus
bandwidth (``intra_node_bandwidth x intra_node_bus_efficiency``); across nodes the ring crosses each
node boundary once per channel through the members' own NICs (rail-aligned, one NIC per GPU), so
``busbw = min(intra, g * inter)`` with ``inter = inter_node_bandwidth x inter_node_bus_efficiency``.

All-to-all and point-to-point run as NCCL grouped send/receive: all-to-all sends ``(g-1)/n^2 B`` over
NVLink and ``(n-g)/n^2 B`` over the NIC concurrently; p2p one message at the link's bus bandwidth.

>>> from autoshard.passes.cost.hardware import PRESETS
>>> h100 = PRESETS["h100"]
>>> big = min(f + p * 1e9 for f, p in nccl_terms("all_reduce", 8, 1, h100))   # 1 GB in one node: NVLS (23 us latency)
>>> round(1e9 * 2 * 7 / 8 / big / 1e9)                                          # bus bandwidth, GB/s
472
>>> small = min(f + p * 1e3 for f, p in nccl_terms("all_reduce", 8, 1, h100))  # 1 kB: latency-bound
>>> round(small * 1e6, 1)
15.0
"""
from __future__ import annotations

import math

__all__ = ["nccl_terms", "nccl_p2p_seconds", "BASE_LAT", "HW_LAT"]

US = 1e-6

#: NCCL src/graph/tuning.cc (NVIDIA/nccl, 2.19-2.21), ``baseLat`` in microseconds:
#: algorithm -> protocol -> base latency of one call.
BASE_LAT = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 0.0},
            "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
            "nvls": {"Simple": 0.0}}
#: ``hwLat`` (same file), microseconds per step: link -> algorithm -> protocol.
HW_LAT = {"nvlink": {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 28.0},
                     "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
                     "nvls": {"Simple": 23.0}},
          "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 28.0},
                  "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}}
#: tuning.cc ``llMaxBws`` (GB/s): LL's whole-call ceiling, one node (Ampere/Hopper) / more nodes (N4).
LL_MAX_BW = {1: 87.7e9, 2: 39.0e9, 4: 20.4e9}
#: tuning.cc: LL128 runs at 120/128 of the line rate (``0.92``), tree at ``0.92`` of the bus
#: bandwidth and half of it as algorithm bandwidth, LL at a quarter (all-reduce / multi-node) or a
#: third of it; a multi-node rank pays at least the network post overhead (1 us, x3 for Simple).
LL128_FACTOR, TREE_FACTOR, TREE_RATIO = 0.92, 0.92, 0.5
NET_OVERHEAD_US = 1.0


def intra_bus(hw) -> float:
    """Achievable NVLink bus bandwidth of one GPU (bytes/s)."""
    return hw.intra_node_bandwidth * getattr(hw, "intra_node_bus_efficiency", 1.0)


def inter_bus(hw) -> float:
    """Achievable bandwidth of one GPU's NIC (bytes/s)."""
    return hw.inter_node_bandwidth * getattr(hw, "inter_node_bus_efficiency", 1.0)


def _bus_bandwidth(hw, g: int, m: int) -> float:
    return intra_bus(hw) if m == 1 else min(intra_bus(hw), g * inter_bus(hw))


def _ll_cap(m: int) -> float:
    return LL_MAX_BW[1 if m == 1 else 2 if m == 2 else 4]


def nccl_terms(kind: str, g: int, m: int, hw) -> list[tuple[float, float]]:
    """Candidate (fixed seconds, seconds per byte of the full per-group B) of one ``kind`` over a group
    of ``g`` members per node on ``m`` nodes, one per (algorithm, protocol) NCCL would consider."""
    n = g * m
    if n <= 1:
        return [(0.0, 0.0)]
    bus = _bus_bandwidth(hw, g, m)
    if kind == "all_to_all":
        intra, inter = intra_bus(hw), inter_bus(hw)
        per_byte = max((g - 1) / n ** 2 / intra, (n - g) / n ** 2 / inter if m > 1 else 0.0)
        lat = BASE_LAT["ring"]["Simple"] + HW_LAT["net" if m > 1 else "nvlink"]["ring"]["Simple"]
        return [(lat * US, per_byte)]
    if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {kind!r}")
    ar = kind == "all_reduce"
    nsteps = 2 * (n - 1) if ar else n - 1
    n_inter = (2 * m if m > 1 else 0) if ar else m - 1
    volume = nsteps / n  # bytes per byte of B each rank streams: 2(n-1)/n or (n-1)/n
    cands = []
    for proto in ("Simple", "LL128", "LL"):
        intra_lat = HW_LAT["nvlink"]["ring"][proto]
        if m > 1:
            intra_lat = max(intra_lat, NET_OVERHEAD_US * (3 if proto == "Simple" else 1))
        lat = (BASE_LAT["ring"][proto] + (nsteps - n_inter) * intra_lat
               + n_inter * HW_LAT["net"]["ring"][proto])
        if proto == "Simple":
            bw = bus
        elif proto == "LL128":
            bw = bus * LL128_FACTOR
        else:
            bw = min(_ll_cap(m), bus * (0.25 if (ar or m > 1) else 1.0 / 3.0))
        cands.append((lat * US, volume / bw))
    if ar:
        for proto in ("Simple", "LL128", "LL"):
            lat = BASE_LAT["tree"][proto] + 2 * ((g - 1) * HW_LAT["nvlink"]["tree"][proto]
                                                 + math.log2(m) * HW_LAT["net"]["tree"][proto])
            bw = bus * TREE_FACTOR
            if proto == "LL":
                bw = min(bw / 3.8, _ll_cap(m))
            elif proto == "LL128":
                bw *= (7.0 / 9.0 if m == 1 else 120.0 / 128.0)
            cands.append((lat * US, 1.0 / (bw * TREE_RATIO)))
        if m == 1 and getattr(hw, "nvls_bus_factor", 0.0) > 0:
            cands.append((HW_LAT["nvlink"]["nvls"]["Simple"] * US, volume / (intra_bus(hw) * hw.nvls_bus_factor)))
    return cands


def nccl_p2p_seconds(hw, nbytes: float, same_node: bool) -> float:
    """One NCCL send/receive of ``nbytes``: ring Simple base latency plus one step, at the link's bus
    bandwidth (NVLink inside a node, the GPU's NIC across nodes)."""
    if same_node:
        bw, step = intra_bus(hw), HW_LAT["nvlink"]["ring"]["Simple"]
    else:
        bw, step = inter_bus(hw), HW_LAT["net"]["ring"]["Simple"]
    return (BASE_LAT["ring"]["Simple"] + step) * US + nbytes / bw
