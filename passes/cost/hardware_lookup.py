"""What a ``hardware=`` argument names: a preset, a JSON file of ``Hardware`` fields, or a measured profile.

``get_hardware`` is the one place that tells these apart, so it sits above both of the modules it
chooses between: ``passes/cost/hardware.py`` (the ``Hardware`` type and its presets) and
``passes/cost/profile_format.py`` (the profile ``autoshard profile`` writes, whose "hardware"
section is what the planner prices with).

A JSON of ``Hardware`` fields may build on a preset: ``{"base": "a100", "inter_node_bandwidth":
50e9}`` is the a100 preset with only the network changed, keeping its measured and cited achievable
rates (GEMM, attention and memory efficiencies, NCCL's collective model); ``base`` may also be the
path of another such JSON. A JSON with neither a base nor any achievable-rate field
(``ACHIEVABLE_FIELDS``) describes datasheet peaks only, so every kernel and collective would be
priced at peak: ``get_hardware`` warns (``PeakPricedWarning``) and says how to fix it.

>>> get_hardware("H100").name
'h100'
>>> from autoshard.passes.mesh import Mesh
>>> get_hardware("h100").axis_link(Mesh.of((2, 8)), 0)  # axis 0 spans two nodes: the NIC
(50000000000.0, 5e-06)
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Union

from autoshard.passes.cost.hardware import PRESETS, Hardware, read_hardware_json
from autoshard.passes.cost.profile_format import Profile
from autoshard.passes.errors import AutoshardError, PeakPricedWarning

__all__ = ["get_hardware", "ACHIEVABLE_FIELDS"]

#: ``Hardware`` fields that say what rate kernels and collectives achieve, below the datasheet's peaks
ACHIEVABLE_FIELDS = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "collective_model",
                     "intra_node_bus_efficiency", "inter_node_bus_efficiency", "collective_fits")


def get_hardware(hardware: Union[str, dict, Hardware, os.PathLike]) -> Hardware:
    """A preset name ("a100", "h100", "h200", "cpu"), a JSON path/dict (``Hardware`` fields, on a
    ``"base"`` preset or alone; or a full profile written by ``autoshard profile``), or a ``Hardware``.

    >>> get_hardware({"base": "a100", "inter_node_bandwidth": 50e9}).gemm_efficiency == PRESETS["a100"].gemm_efficiency
    True
    """
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.lower() in PRESETS:
        return PRESETS[hardware.lower()]
    if isinstance(hardware, str) and not (hardware.endswith(".json") or hardware.lstrip().startswith("{")
                                          or os.path.exists(hardware)):
        raise AutoshardError(
            f"unknown hardware {hardware!r}: use one of the presets {sorted(PRESETS)} or the path of a JSON "
            "profile (a file ending in .json)")
    return _from_json(hardware, ())


def _from_json(source, seen: tuple) -> Hardware:
    """A ``Hardware`` from a JSON source; ``seen``: the bases already followed (a cycle is an error)."""
    data = read_hardware_json(source)
    if "format" in data:  # a full measured profile: its "hardware" section is what the planner uses
        return Profile.from_json(data).hardware
    if "base" not in data:
        if not any(key in data for key in ACHIEVABLE_FIELDS):
            warnings.warn(
                f"hardware {data.get('name', 'custom')!r} gives datasheet peaks and no achievable rates "
                f"({', '.join(ACHIEVABLE_FIELDS[:4])}): every GEMM, copy and collective is priced at peak, "
                f"which makes plans look faster than they run. Build on a preset with \"base\": \"a100\" "
                f"(or h100, h200) and override only what differs, or give those fields",
                PeakPricedWarning, stacklevel=4)
        return Hardware.from_json(data)
    base_name = data["base"]
    if not isinstance(base_name, str):
        raise AutoshardError(f"hardware \"base\" names a preset {sorted(PRESETS)} or a JSON path, got {base_name!r}")
    if base_name.lower() in PRESETS:
        base = PRESETS[base_name.lower()]
    elif base_name in seen:
        raise AutoshardError(f"hardware \"base\" {base_name!r} builds on itself ({' -> '.join(seen + (base_name,))})")
    elif base_name.endswith(".json") or os.path.exists(base_name):
        if not os.path.isabs(base_name) and isinstance(source, (str, os.PathLike)) and os.path.exists(source):
            base_name = os.path.join(os.path.dirname(os.path.abspath(source)), base_name)
        base = _from_json(base_name, seen + (base_name,))
    else:
        raise AutoshardError(f"unknown hardware base {base_name!r}: use one of the presets {sorted(PRESETS)} or the "
                             "path of a hardware JSON")
    overrides = {k: v for k, v in data.items() if k != "base"}
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise AutoshardError(f"hardware JSON on base {data['base']!r} has unknown field(s) {unknown}; known fields: "
                             f"{sorted(names)}")
    return Hardware.from_json({**base.to_json(), **overrides})

