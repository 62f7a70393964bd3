"""A plan on disk: the graph fingerprint, the JSON envelope, reading a file, and older files.

A plan file is one JSON object ``{"format": "autoshard.plan", "version": 2, ...}`` holding a
``Plan`` (``passes.pipeline.plan``): its stages (one without a pipeline), each with its intra-op
Solution, and the schedule. Reading never executes code (no pickle).

Files of version 1 had two kinds, a plan without a pipeline (``"autoshard.plan"``, one Solution) and
a pipelined plan (``"autoshard.pipelined_plan"``); ``upgraded`` reads both as version 2 (a plan of
one stage whose op list is filled in when it is attached to its program, and a plan of the saved
stages). Anything else is a ``PlanFormatError`` that says to plan again.
"""
from __future__ import annotations

import hashlib
import json
import math

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, CapturedGraph

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "graph_fingerprint", "read_plan_json", "upgraded"]

PLAN_FORMAT = "autoshard.plan"
PLAN_VERSION = 2
#: the version-1 format of a pipelined plan (read, never written)
_PIPELINED_V1 = "autoshard.pipelined_plan"


def graph_fingerprint(captured: CapturedGraph) -> str:
    """A hash of the graph's structure (node names, ops, shapes): a saved plan fits only this graph."""
    h = hashlib.sha256()
    for n in captured.gm.graph.nodes:
        h.update(f"{n.op}|{n.name}|{n.target}|{n.meta.get(META)!r};".encode())
    return h.hexdigest()[:16]


def read_plan_json(path: str) -> dict:
    """The plan in ``path`` as a version-2 JSON object (``upgraded``); PlanFormatError when the file is
    not JSON or not a plan this version reads."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"{path} is not valid JSON ({e}); was it written by Plan.save?") from e
    return upgraded(data)


def upgraded(data) -> dict:
    """``data`` (a plan's JSON object, of this version or of version 1) as a version-2 object."""
    if not isinstance(data, dict) or data.get("format") not in (PLAN_FORMAT, _PIPELINED_V1):
        raise PlanFormatError(f"not an autoshard plan: expected a JSON object with format={PLAN_FORMAT!r}")
    version = data.get("version")
    if version == PLAN_VERSION and data["format"] == PLAN_FORMAT:
        return data
    if version != 1:
        raise PlanFormatError(f"plan version {version!r} is not supported (this autoshard reads versions 1 and "
                              f"{PLAN_VERSION}): plan again")
    try:
        return _from_pipelined_v1(data) if data["format"] == _PIPELINED_V1 else _from_plain_v1(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanFormatError(f"malformed version-1 plan ({type(e).__name__}: {e}): plan again") from e


def _envelope(data: dict) -> dict:
    out = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "mesh": data["mesh"], "hardware": data["hardware"],
           "fingerprint": data["fingerprint"], "work": data.get("work")}
    if data.get("source") is not None:
        out["source"] = data["source"]
    return out


def _from_plain_v1(data: dict) -> dict:
    """A version-1 plan without a pipeline: one stage on the whole mesh. Its op list is left empty (the
    file did not record it); ``Plan.attach`` fills it from the program."""
    size = math.prod(int(d) for d in data["mesh"]["shape"])
    stage = {"index": 0, "nodes": [], "group": 0, "ranks": list(range(size)), "mesh": data["mesh"],
             "recompute": False, "solution": data["solution"]}
    return {**_envelope(data), "schedule": "1f1b", "microbatches": 1, "stages": [stage]}


def _from_pipelined_v1(data: dict) -> dict:
    pipe = data["pipeline"]
    return {**_envelope(data), "schedule": pipe["schedule"], "microbatches": pipe["microbatches"],
            "stages": pipe["stages"], "simulated_step_time": pipe.get("estimated_step_time"),
            "bubble_fraction": pipe.get("bubble_fraction", 0.0),
            "peak_activation_memory": pipe.get("peak_activation_memory", []),
            "batch_coupled": data.get("batch_coupled", [])}
