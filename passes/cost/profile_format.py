"""The measured-profile JSON format, the least-squares fits behind it, and loading it as a Hardware.

``autoshard profile --out profile.json`` (``autoshard/profiling/measure.py`` measures) writes one JSON object:

.. code-block:: text

    {"format": "autoshard-profile", "version": 1,
     "machine": {"hostname", "cpu", "nproc", "torch", "device", "backend", "world_size", "date", ...},
     "matmul":      {"dtype", "samples": [[m, k, n, seconds], ...], "held_out": [...],
                     "fit": {"latency_s", "seconds_per_unit"}}                  # unit: one FLOP
     "memory":      {"samples": [[bytes, seconds], ...], "held_out": [...], "fit": {...}}   # large copies
     "elementwise": {"samples": [[bytes, seconds], ...], ...}   # GELU/layer norm/softmax/mul/add, bytes read + written
     "op_overhead": {"samples": [[ops, seconds], ...], "fit": {...}}            # per-op launch cost
     "collectives": [{"kind", "n", "samples": [[B, seconds], ...], "held_out": [...], "fit": {...}}, ...]
                    # n < world: per call, alternating over both axes of an (n, world // n) mesh;
                    # on a CPU each call timed after a little local work, that work's time subtracted
     "hardware":    {the fields of passes.cost.hardware.Hardware}}

``samples`` feed the fits; ``held_out`` points never do: ``held_out_errors`` predicts them from the
fits and reports the relative error. Every fit is ``t = latency_s + seconds_per_unit * x`` by least
squares (``fit_latency_bandwidth``). ``hardware`` is derived from the fits by ``derive_hardware``
when the profile is written and is what the planner prices plans with: ``plan(...,
hardware="profile.json")`` loads it through ``passes.cost.hardware_lookup.get_hardware``.

>>> latency, bandwidth = fit_latency_bandwidth([1e3, 1e4, 1e5], [2e-6 + 1e3 / 1e9, 2e-6 + 1e4 / 1e9, 2e-6 + 1e5 / 1e9])
>>> round(latency, 12), round(bandwidth)
(2e-06, 1000000000)

Only JSON is read from disk, never pickle.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.hardware import COLLECTIVE_KINDS, Hardware

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "Profile", "fit_latency_bandwidth", "fit_affine",
           "derive_hardware", "held_out_errors", "load_profile", "new_profile", "merge_profiles", "STEP_FACTORS"]

PROFILE_FORMAT = "autoshard-profile"
PROFILE_VERSION = 1

#: latency steps per collective in the analytic model, as multiples of (n - 1) (see passes/cost/collectives.py)
STEP_FACTORS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "send_recv": None}
_VOLUME = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n ** 2,
           "send_recv": lambda n: 1.0}


def fit_affine(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = a + b x`` with ``a, b >= 0``: (a, b).

    Relative residuals are minimized (each row weighted by 1 / t), so small messages, whose time is
    mostly latency, count as much as large ones. A negative intercept is clamped to 0 and the slope
    refitted through the origin (and vice versa)."""
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(ts, dtype=np.float64)
    if x.shape != t.shape or x.size < 2:
        raise AutoshardError(f"a fit needs at least 2 (size, seconds) points of equal count, got {x.size} and {t.size}")
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise AutoshardError("fit: every measured time must be a positive finite number")
    w = 1.0 / t
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if a < 0:
        a, b = 0.0, float(np.sum(x * w * w * t) / np.sum((x * w) ** 2))
    if b < 0:
        a, b = float(np.sum(w * w * t) / np.sum(w * w)), 0.0
    return float(a), float(b)


def fit_latency_bandwidth(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(latency s, bandwidth units/s) of ``t = latency + size / bandwidth`` by least squares.

    A fit with no measurable slope reports an infinite bandwidth."""
    a, b = fit_affine(sizes, seconds)
    return a, (1.0 / b if b > 0 else math.inf)


def _fit_of(section: dict) -> tuple[float, float]:
    fit = section["fit"]
    return float(fit["latency_s"]), float(fit["seconds_per_unit"])


def _predict(fit: tuple[float, float], x: float) -> float:
    return fit[0] + fit[1] * x


def matmul_flops(m: float, k: float, n: float) -> float:
    return 2.0 * m * k * n


def held_out_errors(profile: dict) -> list[dict]:
    """Relative prediction error of the fits on every held-out point: [{"what", "size", "measured",
    "predicted", "error"}], error = predicted / measured - 1."""
    rows = []

    def add(what, size, measured, predicted):
        rows.append({"what": what, "size": size, "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1.0})

    mm = profile.get("matmul")
    if mm and mm.get("held_out"):
        fit = _fit_of(mm)
        for m, k, n, t in mm["held_out"]:
            add(f"matmul {int(m)}x{int(k)}x{int(n)}", matmul_flops(m, k, n), t, _predict(fit, matmul_flops(m, k, n)))
    for key, what in (("memory", "copy"), ("elementwise", "elementwise")):
        mem = profile.get(key)
        if mem and mem.get("held_out"):
            fit = _fit_of(mem)
            for b, t in mem["held_out"]:
                add(what, b, t, _predict(fit, b))
    for c in profile.get("collectives", []):
        fit = _fit_of(c)
        for b, t in c.get("held_out", []):
            add(f"{c['kind']} n={c['n']}", b, t, _predict(fit, b))
    return rows


def derive_hardware(profile: dict, name: Optional[str] = None) -> Hardware:
    """The ``Hardware`` a measured profile stands for.

    Matmul fit slope -> achieved FLOP/s (fp32; bf16 from its own fit when measured, else the same);
    elementwise fit slope -> memory bandwidth (the cost model prices every non-matmul op by its bytes,
    and on a CPU GELU or layer norm streams far slower than a copy; the copy fit when absent); tiny-op fit slope -> ``op_overhead_s``; every collective fit
    -> ``collective_fits``. Link bandwidth and latency (used for group sizes that were not measured)
    come from the all-reduce fit of the largest group: ``bandwidth = 2 (n-1)/n / slope`` and the
    intercepts of all fits regressed on their latency-step counts (``intercept = launch + steps *
    latency``). Profiles measure one node: the inter-node link is copied from the intra-node one and
    ``machine.inter_node_measured`` says so."""
    machine = profile.get("machine", {})
    mm = _fit_of(profile["matmul"])
    flops = 1.0 / mm[1] if mm[1] > 0 else 1e18
    bf16 = profile.get("matmul_bf16")
    flops_bf16 = (1.0 / _fit_of(bf16)[1]) if bf16 and _fit_of(bf16)[1] > 0 else flops
    mem = _fit_of(profile["elementwise"] if profile.get("elementwise") else profile["memory"])
    overhead = _fit_of(profile["op_overhead"])[1] if profile.get("op_overhead") else 0.0
    fits, steps, intercepts = [], [], []
    best = None
    for c in profile.get("collectives", []):
        lat, per_byte = _fit_of(c)
        fits.append((c["kind"], int(c["n"]), lat, per_byte))
        factor = STEP_FACTORS.get(c["kind"])
        if factor is not None:
            steps.append(factor * (int(c["n"]) - 1))
            intercepts.append(lat)
        if c["kind"] == "all_reduce" and per_byte > 0 and (best is None or c["n"] > best[0]):
            best = (int(c["n"]), per_byte)
    bandwidth = _VOLUME["all_reduce"](best[0]) / best[1] if best else 1e9
    if len(set(steps)) >= 2:
        launch, latency = fit_affine(steps, intercepts)
    elif steps:
        launch, latency = 0.0, intercepts[0] / steps[0]
    else:
        launch, latency = 0.0, 0.0
    kernels = kernel_table_fields(profile)
    return Hardware(
        name=name or profile.get("name") or f"profile-{machine.get('hostname', 'local')}",
        flops_bf16=kernels.pop("flops_bf16", flops_bf16), flops_fp32=flops,
        memory_bandwidth=kernels.pop("memory_bandwidth", 1.0 / mem[1] if mem[1] > 0 else 1e15),
        memory_bytes=float(machine.get("memory_bytes_per_device", 16e9)),
        devices_per_node=int(machine.get("devices_per_node", machine.get("world_size", 1))),
        intra_node_bandwidth=bandwidth, intra_node_latency=latency,
        inter_node_bandwidth=bandwidth, inter_node_latency=latency,
        collective_launch_s=launch, op_overhead_s=overhead, collective_algorithm="ring",
        collective_fits=tuple(fits), **kernels)


def kernel_table_fields(profile: dict) -> dict:
    """``Hardware`` fields a GPU profile's kernel tables (``autoshard/profiling/kernel_tables.py``)
    measure, replacing the presets' cited constants; empty for a profile without them (a CPU's).

    - ``flops_bf16``: the fastest bf16 GEMM the table holds (the rate the tile/wave model of
      ``kernels.py`` scales from, so ``gemm_efficiency`` is 1.0) and ``sm_count`` the device's;
    - ``attention_efficiency``: the median forward attention rate over that GEMM rate (causal work
      halved, as ``kernels.attention_seconds`` counts it), ``attention_backward_factor`` the median
      backward / forward time;
    - ``memory_bandwidth``: the fastest copy (bytes read + written), ``memory_efficiency`` 1.0;
    - ``comm_streams`` 1: NCCL runs collectives on their own stream."""
    gemms = profile.get("gemm_table", {}).get("rows", [])
    device = profile.get("device", {})
    if not gemms or not device.get("sm_count"):
        return {}
    peak = max(2.0 * m * n * k / s for m, n, k, _layout, s in gemms if s > 0)
    fields = {"flops_bf16": peak, "sm_count": int(device["sm_count"]), "gemm_efficiency": 1.0, "comm_streams": 1}
    attention = profile.get("attention_table", {}).get("rows", [])
    if attention:
        rates = [4.0 * b * h * q * q * d * (0.5 if causal else 1.0) / fwd for b, h, q, d, causal, fwd, _ in attention if fwd > 0]
        fields["attention_efficiency"] = min(1.0, statistics.median(rates) / peak)
        fields["attention_backward_factor"] = statistics.median(bwd / fwd for *_, fwd, bwd in attention if fwd > 0)
    copies = profile.get("copy_table", {}).get("rows", [])
    if copies:
        fields["memory_bandwidth"] = max(moved / s for moved, s in copies if s > 0)
        fields["memory_efficiency"] = 1.0
    return fields


@dataclass
class Profile:
    """A measured profile (the whole JSON object) and the ``Hardware`` it stands for."""
    data: dict
    hardware: Hardware = field(init=False)

    def __post_init__(self):
        if self.data.get("format") != PROFILE_FORMAT:
            raise AutoshardError(f"not an autoshard profile (format {self.data.get('format')!r}, expected "
                                 f"{PROFILE_FORMAT!r}); write one with `autoshard profile --out profile.json`")
        if self.data.get("version") != PROFILE_VERSION:
            raise AutoshardError(f"profile version {self.data.get('version')!r} is not supported (this autoshard "
                                 f"reads version {PROFILE_VERSION}); measure again with `autoshard profile`")
        for key in ("matmul", "memory", "hardware"):
            if key not in self.data:
                raise AutoshardError(f"profile lacks the {key!r} section; measure again with `autoshard profile`")
        for c in self.data.get("collectives", []):
            if c.get("kind") not in COLLECTIVE_KINDS:
                raise AutoshardError(f"profile has a collective of unknown kind {c.get('kind')!r}; "
                                     f"known: {list(COLLECTIVE_KINDS)}")
        self.hardware = Hardware.from_json(self.data["hardware"])

    @classmethod
    def from_json(cls, data: Union[dict, str, os.PathLike]) -> "Profile":
        """From a dict, JSON text, or the path of a JSON file."""
        if isinstance(data, (str, os.PathLike)) and not str(data).lstrip().startswith("{"):
            try:
                with open(data) as f:
                    data = json.load(f)
            except FileNotFoundError as e:
                raise AutoshardError(f"profile {str(data)!r} not found; write one with "
                                     "`autoshard profile --out profile.json`") from e
            except json.JSONDecodeError as e:
                raise AutoshardError(f"profile {str(data)!r} is not valid JSON: {e}") from e
        elif isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict):
            raise AutoshardError(f"a profile is a JSON object, got {type(data).__name__}")
        return cls(data)

    def to_json(self) -> dict:
        return self.data

    def save(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w") as f:
            json.dump(self.data, f, indent=1)

    def held_out_errors(self) -> list[dict]:
        return held_out_errors(self.data)

    def summary(self) -> str:
        """Fits and the held-out prediction error, as printed by ``autoshard profile``."""
        hw, m = self.hardware, self.data.get("machine", {})
        lines = [f"profile {hw.name}: {m.get('device', '?')} x{m.get('world_size', '?')} over "
                 f"{m.get('backend', '?')} ({m.get('cpu', '')}, torch {m.get('torch', '?')})",
                 f"  matmul fp32      {hw.flops_fp32 / 1e9:10.2f} GFLOP/s achieved",
                 f"  elementwise ops  {hw.memory_bandwidth / 1e9:10.2f} GB/s (read + write; the model's memory_bandwidth)",
                 f"  op overhead      {hw.op_overhead_s * 1e6:10.2f} us per op launch"]
        if self.data.get("elementwise") and self.data["memory"]["fit"]["seconds_per_unit"] > 0:
            lines.insert(3, f"  memory (copy)    {1e-9 / self.data['memory']['fit']['seconds_per_unit']:10.2f} GB/s "
                            "(read + write, large copies)")
        for kind, n, lat, per_byte in hw.collective_fits:
            bw = f"{1e-9 / per_byte:8.3f} GB/s of B" if per_byte > 0 else "     inf"
            lines.append(f"  {kind:15s} n={n:<3d} latency {lat * 1e6:9.1f} us  {bw}")
        errs = self.held_out_errors()
        if errs:
            lines.append(f"  held-out prediction error ({len(errs)} points not used by any fit):")
            for e in errs:
                lines.append(f"    {e['what']:24s} size {e['size']:12.4g}  measured {e['measured'] * 1e6:10.1f} us  "
                             f"predicted {e['predicted'] * 1e6:10.1f} us  error {e['error'] * 100:+6.1f}%")
            med = statistics.median(abs(e["error"]) for e in errs)
            lines.append(f"  median |error| on held-out points: {med * 100:.1f}%")
        return "\n".join(lines)


def merge_profiles(first: dict, second: dict) -> dict:
    """One profile from two measurements of the same machine (e.g. before and after a long run, so
    load that drifts in between averages out): samples and held-out points pooled, fits redone,
    ``hardware`` derived again. The machine record is the first's."""
    out = {**first, "collectives": []}
    for key in ("matmul", "matmul_bf16", "memory", "elementwise", "op_overhead"):
        if key in first and key in second:
            samples = first[key]["samples"] + second[key]["samples"]
            width = len(samples[0]) - 1
            xs = [matmul_flops(*s[:3]) if key.startswith("matmul") else s[0] for s in samples]
            a, b = fit_affine(xs, [s[width] for s in samples])
            out[key] = {**first[key], "samples": samples,
                        "held_out": first[key].get("held_out", []) + second[key].get("held_out", []),
                        "fit": {"latency_s": a, "seconds_per_unit": b}}
    later = {(c["kind"], c["n"]): c for c in second.get("collectives", [])}
    for c in first.get("collectives", []):
        d = later.get((c["kind"], c["n"]))
        if d is None:
            out["collectives"].append(c)
            continue
        samples = c["samples"] + d["samples"]
        a, b = fit_affine([s[0] for s in samples], [s[1] for s in samples])
        out["collectives"].append({**c, "samples": samples, "held_out": c.get("held_out", []) + d.get("held_out", []),
                                   "fit": {"latency_s": a, "seconds_per_unit": b}})
    out["seconds"] = first.get("seconds", 0.0) + second.get("seconds", 0.0)
    out["hardware"] = derive_hardware(out, first.get("name")).to_json()
    return out


def load_profile(path: Union[str, os.PathLike, dict]) -> Profile:
    """Read a profile written by ``autoshard profile`` (JSON only)."""
    return Profile.from_json(path)


def new_profile(machine: dict[str, Any]) -> dict:
    """An empty profile skeleton the profiler fills in."""
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "machine": dict(machine), "collectives": []}
