"""Hardware the cost model prices a plan on: compute peaks, memory, and the links of each mesh axis.

A ``Hardware`` is a typed, immutable description of ONE device and how it talks to its peers. The
presets come from vendor datasheets (each constant cites its source); latencies and the per-call
collective overhead are estimates (NCCL-tests small-message figures), marked as such. A profile
measured on a real cluster loads from JSON with the same field names:

>>> from autoshard.passes.mesh import Mesh
>>> hw = Hardware.from_json({"name": "mine", "flops_bf16": 1e15, "flops_fp32": 6e13,
...                          "memory_bandwidth": 3e12, "memory_bytes": 8e10, "devices_per_node": 8,
...                          "intra_node_bandwidth": 4.5e11, "intra_node_latency": 2e-6,
...                          "inter_node_bandwidth": 5e10, "inter_node_latency": 5e-6})
>>> hw.axis_link(Mesh.of((2, 8)), 1)     # 8 devices along the last axis fit one node: NVLink
(450000000000.0, 2e-06)
>>> hw.axis_link(Mesh.of((2, 8)), 0)     # axis 0 spans 16 devices, two nodes: the NIC
(50000000000.0, 5e-06)

Mesh axis ``a`` stays inside one node when ``shape[a] * shape[a+1] * ... <= devices_per_node``
(row-major rank layout: later axes vary fastest), so it uses the intra-node link; otherwise the
inter-node one. ``axis_locality`` says how an axis that crosses nodes splits: ``g`` members share
each node and ``m`` nodes take part, which the cost model prices as a two-level (hierarchical)
collective.

Measured profiles (``autoshard profile``, ``passes/cost/profile_format.py``) add what a datasheet cannot
give: ``op_overhead_s`` (host cost of launching one op, forward or backward) and
``collective_fits``, one ``(kind, group size, latency s, seconds per byte)`` per measured
collective, which the cost model uses in place of the analytic formula for intra-node groups of
that size. ``collective_algorithm`` picks the all-reduce model: "ring", "tree" or "auto" (the
cheaper of the two for each message, as NCCL's tuner does).

This module knows nothing of profiles: ``passes/cost/hardware_lookup.py``'s ``get_hardware`` turns a
preset name, a JSON file of these fields, or a whole measured profile into a ``Hardware``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from autoshard.passes.errors import AutoshardError
from autoshard.passes.mesh import Mesh

__all__ = ["Hardware", "PRESETS", "read_hardware_json", "COLLECTIVE_KINDS", "ALGORITHMS"]

GB = 1e9

#: Collectives a profile may carry fits for ("send_recv": a point-to-point exchange between pairs).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ALGORITHMS = ("ring", "tree", "auto")
_MAY_BE_ZERO = ("intra_node_latency", "inter_node_latency", "collective_launch_s", "op_overhead_s", "sm_count",
                 "min_kernel_s", "nvls_bus_factor", "comm_streams")
_NOT_NUMBERS = ("name", "collective_fits", "collective_algorithm", "collective_model")
COLLECTIVE_MODELS = ("analytic", "nccl")
_FRACTIONS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "intra_node_bus_efficiency",
              "inter_node_bus_efficiency")


@dataclass(frozen=True)
class Hardware:
    """One device and its links. Units: FLOP/s, bytes/s, bytes, seconds.

    Bandwidths are per device and per direction (what a ring collective streams through each link).
    ``collective_launch_s`` is the fixed cost of one collective call (kernel launch, stream sync),
    paid once per call whatever its size. ``op_overhead_s`` is the fixed host cost of one op
    (dispatch and launch), paid by every rank for every non-view op and every backward op, however
    small its shard. ``collective_fits``: measured ``(kind, n, latency_s, seconds_per_byte)``
    tuples, ``t(B) = latency_s + seconds_per_byte * B`` with ``B`` the full per-group bytes.
    """
    name: str
    flops_bf16: float
    flops_fp32: float
    memory_bandwidth: float
    memory_bytes: float
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    collective_launch_s: float = 5e-6
    op_overhead_s: float = 0.0
    collective_algorithm: str = "ring"
    collective_fits: tuple = ()
    # achievable compute (``passes/cost/kernels.py``); sm_count 0: price at the peaks, as before
    sm_count: int = 0
    gemm_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    min_kernel_s: float = 0.0
    #: fused attention's backward seconds per forward second (FlashAttention-2, Dao 2023, sec. 3.1:
    #: 2.5x the forward's FLOPs); the H100/H200 presets and a measured profile set what their kernel took
    attention_backward_factor: float = 2.5
    # collectives as NCCL runs them (``passes/cost/nccl.py``); "analytic": the link formulas above
    collective_model: str = "analytic"
    # achievable NCCL bus bandwidth as a fraction of the link fields above (so a changed link scales it),
    # and NVLink SHARP's all-reduce bus bandwidth as a multiple of the NVLink one (0: no NVLS)
    intra_node_bus_efficiency: float = 1.0
    inter_node_bus_efficiency: float = 1.0
    nvls_bus_factor: float = 0.0
    # 1: collectives run on their own stream and overlap compute (``passes/cost/overlap.py``);
    # 0: a collective blocks the caller (gloo on a CPU)
    comm_streams: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name in _NOT_NUMBERS:
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and f.name not in _MAY_BE_ZERO):
                raise AutoshardError(
                    f"hardware {self.name!r}: {f.name} must be a positive number, got {v!r}")
        for f in _FRACTIONS:
            if getattr(self, f) > 1.0:
                raise AutoshardError(f"hardware {self.name!r}: {f} is a fraction of the peak (0 < x <= 1), "
                                     f"got {getattr(self, f)!r}")
        if self.collective_model not in COLLECTIVE_MODELS:
            raise AutoshardError(f"hardware {self.name!r}: collective_model must be one of {list(COLLECTIVE_MODELS)}, "
                                 f"got {self.collective_model!r}")
        if self.collective_algorithm not in ALGORITHMS:
            raise AutoshardError(f"hardware {self.name!r}: collective_algorithm must be one of {list(ALGORITHMS)}, "
                                 f"got {self.collective_algorithm!r}")
        fits = []
        for entry in self.collective_fits:
            try:
                kind, n, lat, per_byte = entry
                fit = (str(kind), int(n), float(lat), float(per_byte))
            except (TypeError, ValueError) as e:
                raise AutoshardError(f"hardware {self.name!r}: each collective_fits entry is [kind, group size, "
                                     f"latency_s, seconds_per_byte], got {entry!r}") from e
            if fit[0] not in COLLECTIVE_KINDS or fit[1] < 2 or fit[2] < 0 or fit[3] < 0:
                raise AutoshardError(f"hardware {self.name!r}: bad collective fit {entry!r}: kind in "
                                     f"{list(COLLECTIVE_KINDS)}, group size >= 2, non-negative latency and slope")
            fits.append(fit)
        object.__setattr__(self, "collective_fits", tuple(fits))

    def collective_fit(self, kind: str, n: int) -> Optional[tuple[float, float]]:
        """(latency_s, seconds_per_byte) measured for ``kind`` over ``n`` devices, or None."""
        for k, size, lat, per_byte in self.collective_fits:
            if k == kind and size == n:
                return lat, per_byte
        return None

    def axis_locality(self, mesh: Mesh, axis: int) -> tuple[int, int]:
        """(members per node g, nodes m) of one group along ``axis``; g * m == mesh.shape[axis].

        Members of a group are ``stride = prod(shape[axis+1:])`` ranks apart, and nodes hold
        ``devices_per_node`` consecutive ranks. An axis inside one node is (n, 1); when the
        members cannot be split evenly over nodes it is treated as (1, n): every hop crosses nodes.
        """
        n = mesh.shape[axis]
        stride = math.prod(mesh.shape[axis + 1:])
        if n * stride <= self.devices_per_node:
            return n, 1
        g = max(1, min(n, self.devices_per_node // stride))
        if n % g or self.devices_per_node % stride:
            return 1, n
        return g, n // g

    def group_locality(self, mesh: Mesh, axes) -> tuple[int, int]:
        """(members per node g, nodes m) of one group over mesh ``axes`` flattened (an int: one axis,
        ``axis_locality``); g * m == the product of their sizes.

        Adjacent axes flatten into one axis of the merged mesh. Otherwise the group of rank 0 is
        counted node by node; members spread unevenly over nodes count as (1, n), as in
        ``axis_locality``.

        >>> h = PRESETS["h100"]                        # 8 GPUs per node
        >>> h.group_locality(Mesh.of((8, 8)), (0, 1))  # all 64 ranks: 8 per node, 8 nodes
        (8, 8)
        >>> h.group_locality(Mesh.of((4, 2, 8)), (0, 2))
        (8, 4)
        """
        axes = (axes,) if isinstance(axes, int) else tuple(sorted(axes))
        if len(axes) == 1:
            return self.axis_locality(mesh, axes[0])
        shape = mesh.shape
        if axes == tuple(range(axes[0], axes[-1] + 1)):
            merged = shape[:axes[0]] + (math.prod(shape[a] for a in axes),) + shape[axes[-1] + 1:]
            return self.axis_locality(Mesh.of(merged), axes[0])
        ranks = [0]
        for a in axes:
            stride = math.prod(shape[a + 1:])
            ranks = [r + i * stride for r in ranks for i in range(shape[a])]
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r // self.devices_per_node] = per_node.get(r // self.devices_per_node, 0) + 1
        counts = set(per_node.values())
        if len(counts) != 1:
            return 1, len(ranks)
        return counts.pop(), len(per_node)

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Dense peak for matmuls in ``dtype`` (16-bit floats use the bf16 tensor-core peak)."""
        if dtype in (torch.bfloat16, torch.float16) or (dtype.is_floating_point and dtype.itemsize == 1):
            return self.flops_bf16
        return self.flops_fp32

    def axis_link(self, mesh: Mesh, axis: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the link mesh axis ``axis`` communicates over."""
        span = math.prod(mesh.shape[axis:])
        if span <= self.devices_per_node:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Union[dict, str, os.PathLike]) -> "Hardware":
        """Build from a dict, a JSON text, or a path to a JSON file (same keys as the fields).

        A full measured profile (a JSON object with a "format" key) is not a ``Hardware``: load it
        with ``passes.cost.hardware_lookup.get_hardware``, which takes its "hardware" section."""
        data = read_hardware_json(data)
        if "format" in data:
            raise AutoshardError("this JSON is a full measured profile, not Hardware fields: load it with "
                                 "get_hardware(...) (passes.cost.hardware_lookup), which uses its 'hardware' section")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise AutoshardError(f"hardware profile has unknown field(s) {unknown}; known fields: {sorted(names)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data) - {"name"})
        if missing:
            raise AutoshardError(f"hardware profile lacks field(s) {missing}")
        values = dict(data)
        values.setdefault("name", "custom")
        values["devices_per_node"] = int(values["devices_per_node"])
        for key in ("sm_count", "comm_streams"):
            if key in values:
                values[key] = int(values[key])
        values["collective_fits"] = tuple(tuple(e) if isinstance(e, list) else e
                                          for e in values.get("collective_fits", ()))
        return cls(**values)


def read_hardware_json(data: Union[dict, str, os.PathLike]) -> dict:
    """The JSON object a ``hardware=`` argument names: a dict as is, a JSON text parsed, or the path of
    a JSON file read. ``AutoshardError`` names a missing file, invalid JSON, or a non-object."""
    if isinstance(data, (str, os.PathLike)):
        text = str(data)
        if text.lstrip().startswith("{"):
            data = json.loads(text)
        else:
            try:
                with open(text) as f:
                    data = json.load(f)
            except FileNotFoundError as e:
                raise AutoshardError(
                    f"hardware profile {text!r} not found: pass a preset name {sorted(PRESETS)} or the "
                    f"path of a JSON file with the fields {[f.name for f in dataclasses.fields(Hardware)]}") from e
            except json.JSONDecodeError as e:
                raise AutoshardError(f"hardware profile {text!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise AutoshardError(f"a hardware profile is a JSON object, got {type(data).__name__}")
    return data


def _achievable(**specific) -> dict:
    """The achievable-throughput and NCCL fields of a GPU preset: the part-specific ones given, and
    these shared by the three presets."""
    shared = dict(
        memory_efficiency=0.90,    # copy/STREAM-style kernels reach ~90% of datasheet HBM bandwidth on
                                   # HBM2e/HBM3 parts (published copy microbenchmarks, e.g. BabelStream on
                                   # A100/H100; a 4 GiB copy at 90.6% on an H100-class card); estimate
        min_kernel_s=3e-6,         # estimate: the shortest a launched kernel lasts end to end (launch,
                                   # ramp, tail), a few microseconds on A100/H100 (CUDA C++ Best Practices
                                   # Guide: launch overhead of the order of microseconds)
        collective_model="nccl",   # price collectives as NCCL's own tuner does (passes/cost/nccl.py)
        comm_streams=1,            # PyTorch's ProcessGroupNCCL runs collectives on their own CUDA stream
                                   # (FSDP2 prefetches all-gathers there; DDP buckets all-reduce in backward)
    )
    return {**shared, **specific}


#: Presets. SXM parts, DGX-style nodes of 8 GPUs. Sources: NVIDIA A100 datasheet (2021), H100
#: datasheet (2023), H200 datasheet (2024), DGX A100 / DGX H100 user guides (one ConnectX NIC per GPU).
PRESETS: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100",
        flops_bf16=312e12,             # A100 SXM datasheet: BF16 tensor core 312 TFLOPS (dense)
        flops_fp32=19.5e12,            # A100 datasheet: FP32 19.5 TFLOPS (TF32 tensor core: 156, not default)
        memory_bandwidth=2.039e12,     # A100 80GB SXM datasheet: HBM2e 2,039 GB/s
        memory_bytes=80 * GB,          # A100 80GB
        devices_per_node=8,            # DGX A100: 8 GPUs
        intra_node_bandwidth=300 * GB,  # NVLink3 600 GB/s total bidirectional -> 300 GB/s each way
        intra_node_latency=2e-6,       # estimate: NCCL ring step over NVLink, a few microseconds
        inter_node_bandwidth=25 * GB,  # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s
        inter_node_latency=5e-6,       # estimate: InfiniBand RDMA round trip plus NCCL proxy
        collective_launch_s=5e-6,      # estimate: NCCL kernel launch and stream synchronization
        op_overhead_s=0.0,             # estimate: CUDA launches are asynchronous, hidden behind earlier kernels
        **_achievable(
            sm_count=108,              # A100 whitepaper (NVIDIA Ampere GA100 architecture): 108 SMs on A100
            gemm_efficiency=257 / 312 * 19 / (2048 / 108),  # published microbenchmark (He 2024, "Strangely,
                                       # matrix multiplications on GPUs run faster when given predictable
                                       # data", thonking.ai): 8192^3 matmuls with torch.randn inputs on an A100
                                       # SXM at its 400 W limit, 257 TFLOPS (295 with zeros: the power limit
                                       # binds); the same measurement as the H100 / H200 presets' (random data,
                                       # 8192^3, power-limited), 2048 tiles of 128x256 = 18.96 waves, so the
                                       # whole-wave cap is 19/18.96 of it (0.825). The "MAMF" figure (267.9,
                                       # Bekman, ml-engineering) is a burst maximum over shapes
            attention_efficiency=0.60,  # FlashAttention-2 (Dao 2023), abstract: 50-73% of peak on A100; the
                                       # backward (2.5x the forward's FLOPs) runs at the low end: 0.60
            intra_node_bus_efficiency=240 / 300,  # NCCL src/graph/topo.h: SM80_NVLINK_BW 20 GB/s per link x 12
                                       # NVLink3 links = 240 GB/s, the bus bandwidth NCCL's tuner assumes
            inter_node_bus_efficiency=23.5 / 25,  # HDR 200 Gb/s NIC (25 GB/s) at the rate ASTRA-sim's
                                       # calbusbw.h uses for ConnectX-6 (CX6_BW 23.5)
            nvls_bus_factor=0.0,       # NVLink SHARP needs third-generation NVSwitch (Hopper): none on A100
        ),
    ),
    "h100": Hardware(
        name="h100",
        flops_bf16=989e12,             # H100 SXM datasheet: BF16 tensor core 1,979 TFLOPS with sparsity, 989 dense
        flops_fp32=67e12,              # H100 SXM datasheet: FP32 67 TFLOPS
        memory_bandwidth=3.35e12,      # H100 SXM datasheet: HBM3 3.35 TB/s
        memory_bytes=80 * GB,          # H100 SXM: 80 GB
        devices_per_node=8,            # DGX H100 / HGX H100: 8 GPUs
        intra_node_bandwidth=450 * GB,  # NVLink4 900 GB/s total bidirectional -> 450 GB/s each way
        intra_node_latency=2e-6,       # estimate (as A100)
        inter_node_bandwidth=50 * GB,  # DGX H100: one 400 Gb/s NDR ConnectX-7 per GPU = 50 GB/s
        inter_node_latency=5e-6,       # estimate
        collective_launch_s=5e-6,      # estimate
        op_overhead_s=0.0,             # estimate: asynchronous launches (as A100)
        **_achievable(
            sm_count=132,              # H100 whitepaper (NVIDIA Hopper architecture): 132 SMs on H100 SXM5
            gemm_efficiency=685.1 / 989 * 16 / 15.5,  # measured profile, benchmarks/gpu_fidelity_probe.py on
                                       # one H100 SXM 80GB HBM3 (2026-11-25): back-to-back 8192^3 bf16 GEMMs
                                       # for 30 s run at the 700 W power limit, SM clock 1350-1395 MHz, 685.1
                                       # TFLOPS mean; that shape is 15.5 waves of 128x256 tiles, so the
                                       # whole-wave cap is 16/15.5 of it (0.715). The "MAMF" burst figure
                                       # (792.1, Bekman, ml-engineering) is the rate before the power limit
                                       # pulls the clock down (787 in this run's first GEMMs). Check: a
                                       # measured torchtitan 8B layer (gpu_layer_probe.py) is predicted
                                       # within 2% at this rate, 8% fast at the burst one
            attention_efficiency=0.602,  # measured: PyTorch SDPA's default kernel on H100 in torch 2.11 (cuDNN
                                       # attention), bf16, causal, sequence 8192, head_dim 128 at 8, 16 and 32
                                       # heads (Llama-3 70B / 405B under TP 8, and 8B): the median forward rate
                                       # of the six such rows of benchmarks/data/h100_calibration.json (lead's
                                       # gpu_calibration.py) and benchmarks/gpu_layer_probe_h100.json (another
                                       # H100, same day): 0.50-0.64 of peak. SDPA held to its flash kernel
                                       # (FlashAttention-2, first in torch's 2024 priority order) runs at 0.305
            attention_backward_factor=3.05,  # the same rows: median backward / forward time 3.05 (2.74-3.38);
                                       # more than FlashAttention-2's 2.5x FLOPs (Dao 2023), which the flash
                                       # kernel matches (2.53 in the probe)
            intra_node_bus_efficiency=370.8 / 450,  # NCCL src/graph/topo.h: SM90_NVLINK_BW 20.6 GB/s per
                                       # link x 18 NVLink4 links = 370.8 GB/s
            inter_node_bus_efficiency=48.5 / 50,  # NDR 400 Gb/s ConnectX-7 (50 GB/s) at ASTRA-sim's calbusbw.h
                                       # rate (CX7_BW 48.5)
            nvls_bus_factor=475 / 370.8,  # NVLink SHARP all-reduce on DGX/HGX H100 NVSwitch (NCCL >= 2.17):
                                       # ASTRA-sim calbusbw.h H100_NVLS_BW 475 GB/s bus bandwidth
        ),
    ),
    "h200": Hardware(
        name="h200",
        flops_bf16=989e12,             # H200 SXM datasheet: same tensor cores as H100 SXM
        flops_fp32=67e12,              # H200 SXM datasheet: FP32 67 TFLOPS
        memory_bandwidth=4.8e12,       # H200 datasheet: HBM3e 4.8 TB/s
        memory_bytes=141 * GB,         # H200 datasheet: 141 GB
        devices_per_node=8,            # HGX H200: 8 GPUs
        intra_node_bandwidth=450 * GB,  # NVLink4 900 GB/s total bidirectional -> 450 GB/s each way
        intra_node_latency=2e-6,       # estimate
        inter_node_bandwidth=50 * GB,  # 400 Gb/s NDR per GPU = 50 GB/s
        inter_node_latency=5e-6,       # estimate
        collective_launch_s=5e-6,      # estimate
        op_overhead_s=0.0,             # estimate: asynchronous launches (as A100)
        **_achievable(
            sm_count=132,              # H200: the same GH100 die as H100 SXM, 132 SMs
            gemm_efficiency=672.4 / 989 * 16 / 15.5,  # measured profile, benchmarks/gpu_sustained_gemm.py on one
                                       # H200 (2026-11-25): 8192^3 bf16 GEMMs back to back for 30 s at the
                                       # 700 W limit, SM clock 1470-1500 MHz, 672.4 TFLOPS mean (791.5 in
                                       # the first products); whole-wave cap as for H100
            attention_efficiency=0.581,  # measured, as H100: the median forward rate of the causal, sequence
                                       # 8192, head_dim 128 rows (8, 16, 32 heads) of benchmarks/data/
                                       # h200_profile.json (autoshard profile, torch 2.11, SDPA's default kernel)
            attention_backward_factor=2.94,  # the same rows: median backward / forward time (2.71-2.99)
            intra_node_bus_efficiency=370.8 / 450,  # as H100: NVLink4, 18 links x 20.6 GB/s (NCCL topo.h)
            inter_node_bus_efficiency=48.5 / 50,  # as H100: NDR 400 Gb/s (ASTRA-sim calbusbw.h CX7_BW)
            nvls_bus_factor=475 / 370.8,  # HGX H200: the same NVSwitch and NVLink SHARP as H100
        ),
    ),
    # Every number below is an ESTIMATE for a small 2-core x86 machine where the "devices" are
    # processes talking gloo over loopback TCP.
    "cpu": Hardware(
        name="cpu",
        flops_bf16=20e9,               # estimate: bf16 matmul on AVX2 without AMX is slower than fp32
        flops_fp32=50e9,               # estimate: ~2 cores x 3 GHz x 16 FLOP/cycle x ~50% efficiency
        memory_bandwidth=10 * GB,      # estimate: one DDR4 channel share
        memory_bytes=16 * GB,          # estimate
        devices_per_node=1024,         # every process lives on the one machine
        intra_node_bandwidth=2 * GB,   # estimate: gloo ring over loopback TCP
        intra_node_latency=50e-6,      # estimate: loopback TCP round trip through gloo
        inter_node_bandwidth=1.25 * GB,  # estimate: 10 GbE, unused while all ranks share one machine
        inter_node_latency=100e-6,     # estimate
        collective_launch_s=20e-6,     # estimate: gloo call overhead
        op_overhead_s=10e-6,           # estimate: ATen dispatch + autograd bookkeeping per op in eager PyTorch
    ),
}
