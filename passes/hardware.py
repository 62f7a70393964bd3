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
inter-node one.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Union

import torch

from .errors import AutoshardError
from .mesh import Mesh

__all__ = ["Hardware", "PRESETS", "get_hardware", "axis_link"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One device and its links. Units: FLOP/s, bytes/s, bytes, seconds.

    Bandwidths are per device and per direction (what a ring collective streams through each link).
    ``collective_launch_s`` is the fixed cost of one collective call (kernel launch, stream sync),
    paid once per call whatever its size.
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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and f.name not in (
                    "intra_node_latency", "inter_node_latency", "collective_launch_s")):
                raise AutoshardError(
                    f"hardware {self.name!r}: {f.name} must be a positive number, got {v!r}")

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
        """Build from a dict, a JSON text, or a path to a JSON file (same keys as the fields)."""
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
                        f"path of a JSON file with the fields {[f.name for f in dataclasses.fields(cls)]}") from e
                except json.JSONDecodeError as e:
                    raise AutoshardError(f"hardware profile {text!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise AutoshardError(f"a hardware profile is a JSON object, got {type(data).__name__}")
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
        return cls(**values)


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
    ),
}


def get_hardware(hardware: Union[str, dict, Hardware, os.PathLike]) -> Hardware:
    """A preset name ("a100", "h100", "h200", "cpu"), a JSON profile path/dict, or a ``Hardware``."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.lower() in PRESETS:
        return PRESETS[hardware.lower()]
    if isinstance(hardware, str) and not (hardware.endswith(".json") or hardware.lstrip().startswith("{")
                                          or os.path.exists(hardware)):
        raise AutoshardError(
            f"unknown hardware {hardware!r}: use one of the presets {sorted(PRESETS)} or the path of a JSON "
            "profile (a file ending in .json)")
    return Hardware.from_json(hardware)


def axis_link(mesh: Mesh, axis: int, hardware: Union[str, Hardware] = "h100") -> tuple[float, float]:
    """Module-level form of ``Hardware.axis_link``."""
    return get_hardware(hardware).axis_link(mesh, axis)
