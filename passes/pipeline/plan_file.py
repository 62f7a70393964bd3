"""What both plan kinds share on disk: the graph fingerprint, the JSON envelope, reading a file.

A plan file is one JSON object ``{"format": ..., "version": ..., ...}``: ``"autoshard.plan"`` for a
``Plan`` (one program on one mesh), ``"autoshard.pipelined_plan"`` for a ``PipelinedPlan`` (pipeline
stages, each with its own intra-op plan). Reading never executes code (no pickle).
"""
from __future__ import annotations

import hashlib
import json

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, CapturedGraph

__all__ = ["PLAN_FORMAT", "PIPELINED_FORMAT", "PLAN_VERSION", "graph_fingerprint", "read_plan_json", "check_envelope"]

PLAN_FORMAT = "autoshard.plan"
PIPELINED_FORMAT = "autoshard.pipelined_plan"
PLAN_VERSION = 1


def graph_fingerprint(captured: CapturedGraph) -> str:
    """A hash of the graph's structure (node names, ops, shapes): a saved plan fits only this graph."""
    h = hashlib.sha256()
    for n in captured.gm.graph.nodes:
        h.update(f"{n.op}|{n.name}|{n.target}|{n.meta.get(META)!r};".encode())
    return h.hexdigest()[:16]


def read_plan_json(path: str) -> dict:
    """The JSON object in ``path``; PlanFormatError when it is not JSON or not a plan of either kind."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"{path} is not valid JSON ({e}); was it written by Plan.save?") from e
    if not isinstance(data, dict) or data.get("format") not in (PLAN_FORMAT, PIPELINED_FORMAT):
        raise PlanFormatError(f"not an autoshard plan: expected a JSON object with format={PLAN_FORMAT!r} or "
                              f"{PIPELINED_FORMAT!r}")
    return data


def check_envelope(data: dict, fmt: str) -> None:
    """Raise PlanFormatError unless ``data`` is a JSON object of format ``fmt`` at a version this reads."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise PlanFormatError(f"not an autoshard plan: expected a JSON object with format={fmt!r}")
    if data.get("version") != PLAN_VERSION:
        raise PlanFormatError(
            f"plan version {data.get('version')!r} is not supported (this autoshard reads version {PLAN_VERSION})")
