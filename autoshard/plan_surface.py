"""``PlanSurface``: what every plan the front door returns offers, written once.

``Plan`` (``autoshard.plans``) and ``PipelinedPlan`` (``autoshard.pipelined_plans``) both derive from
it. Each supplies its decisions and estimates (``estimated_step_time``, ``estimated_memory``), its
account (``summary``), its picture (``to_dot``), its JSON (``to_json``) and ``work`` (one step's model
FLOPs, tokens and the hardware's peak, ``metrics.ModelWork``); the surface derives from them the
throughput and MFU (``autoshard.metrics``' conventions), ``render``, ``save`` and the fingerprint check
``attach`` makes.
"""
from __future__ import annotations

import json
from typing import Optional

from autoshard.drawing import render_dot
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.plan_format import graph_fingerprint

__all__ = ["PlanSurface"]


class PlanSurface:
    """The shared surface of a plan (module docstring). Subclasses are dataclasses with ``mesh``,
    ``fingerprint`` and ``work`` fields."""

    # ---- what a plan supplies --------------------------------------------------------------------
    @property
    def estimated_step_time(self) -> float:
        raise NotImplementedError

    @property
    def estimated_memory(self) -> int:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    def to_dot(self, detail: str = "blocks") -> str:
        raise NotImplementedError

    def to_json(self) -> dict:
        raise NotImplementedError

    # ---- throughput ------------------------------------------------------------------------------
    @property
    def model_flops(self) -> Optional[float]:
        """Model FLOPs of one step over all devices (``autoshard.metrics``: matmul FLOPs x3 for training)."""
        return self.work.flops if self.work else None

    @property
    def tokens_per_second_per_device(self) -> Optional[float]:
        """Estimated tokens per second per device (None when the inputs carry no token ids)."""
        return self.work.rate(self.estimated_step_time) if self.work and self.work.tokens else None

    @property
    def samples_per_second_per_device(self) -> Optional[float]:
        """Estimated samples (rows of the global batch) per second per device."""
        return self.work.samples_rate(self.estimated_step_time) if self.work else None

    @property
    def mfu(self) -> Optional[float]:
        """Estimated model FLOPs utilization against the hardware's dense peak (0..1; ``autoshard.metrics``)."""
        return self.work.mfu(self.estimated_step_time) if self.work else None

    # ---- pictures and files ------------------------------------------------------------------------
    def render(self, path: str, detail: str = "blocks") -> str:
        """Draw the plan to ``path`` (.svg, .png or .pdf) at ``detail`` (see ``to_dot``). Without
        graphviz's ``dot`` program, writes ``path`` with suffix .dot instead and raises RuntimeError
        saying how to render it."""
        return render_dot(self.to_dot(detail), path)

    def save(self, path: str) -> None:
        """Write the plan as JSON (never pickle); ``autoshard.load_plan`` reads it back."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    def check_binds(self, captured: CapturedGraph, mesh=None) -> None:
        """Raise ``PlanFormatError`` unless this plan was made for ``captured``'s program (its graph
        fingerprint) and, when given, for ``mesh``'s shape."""
        if mesh is not None and Mesh.of(mesh).shape != self.mesh.shape:
            raise PlanFormatError(f"plan was made for mesh {self.mesh.shape}, not {Mesh.of(mesh).shape}: plan again")
        fp = graph_fingerprint(captured)
        if fp != self.fingerprint:
            raise PlanFormatError(
                "plan was made for a different model or input shapes (graph fingerprint "
                f"{self.fingerprint} != {fp}): plan again for this model")
