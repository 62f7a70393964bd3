"""What a ``hardware=`` argument names: a preset, a JSON file of ``Hardware`` fields, or a measured profile.

``get_hardware`` is the one place that tells these apart, so it sits above both of the modules it
chooses between: ``passes/cost/hardware.py`` (the ``Hardware`` type and its presets) and
``passes/cost/profile_format.py`` (the profile ``autoshard profile`` writes, whose "hardware"
section is what the planner prices with).

>>> get_hardware("H100").name
'h100'
>>> from autoshard.passes.mesh import Mesh
>>> axis_link(Mesh.of((2, 8)), 0, "h100")      # axis 0 spans two nodes: the NIC
(50000000000.0, 5e-06)
"""
from __future__ import annotations

import os
from typing import Union

from autoshard.passes.cost.hardware import PRESETS, Hardware, read_hardware_json
from autoshard.passes.cost.profile_format import Profile
from autoshard.passes.errors import AutoshardError
from autoshard.passes.mesh import Mesh

__all__ = ["get_hardware", "axis_link"]


def get_hardware(hardware: Union[str, dict, Hardware, os.PathLike]) -> Hardware:
    """A preset name ("a100", "h100", "h200", "cpu"), a JSON path/dict (``Hardware`` fields, or a full
    profile written by ``autoshard profile``), or a ``Hardware``."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.lower() in PRESETS:
        return PRESETS[hardware.lower()]
    if isinstance(hardware, str) and not (hardware.endswith(".json") or hardware.lstrip().startswith("{")
                                          or os.path.exists(hardware)):
        raise AutoshardError(
            f"unknown hardware {hardware!r}: use one of the presets {sorted(PRESETS)} or the path of a JSON "
            "profile (a file ending in .json)")
    data = read_hardware_json(hardware)
    if "format" in data:  # a full measured profile: its "hardware" section is what the planner uses
        return Profile.from_json(data).hardware
    return Hardware.from_json(data)


def axis_link(mesh: Mesh, axis: int, hardware: Union[str, Hardware] = "h100") -> tuple[float, float]:
    """Module-level form of ``Hardware.axis_link``."""
    return get_hardware(hardware).axis_link(mesh, axis)
