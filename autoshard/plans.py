"""``Plan``: the solver's decisions for one model on one mesh, with its estimates and pictures.

A Plan is data: it saves to JSON (``Plan.save``) and loads back without executing code
(``autoshard.load_plan``). It keeps the captured graph when it has one (for drawing and compiling);
a loaded plan carries only the decisions and re-attaches to a graph when compiled, after checking
that the graph's fingerprint matches.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

from autoshard.drawing import plan_to_dot, render_dot
from autoshard.explain import explain
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import fmt_placements
from autoshard.summary import plan_summary

PLAN_FORMAT = "autoshard.plan"
PLAN_VERSION = 1


def graph_fingerprint(captured: CapturedGraph) -> str:
    """A hash of the graph's structure (node names, ops, shapes): a saved plan fits only this graph."""
    h = hashlib.sha256()
    for n in captured.gm.graph.nodes:
        h.update(f"{n.op}|{n.name}|{n.target}|{n.meta.get(META)!r};".encode())
    return h.hexdigest()[:16]


@dataclass
class Plan:
    """How every op, parameter and input is placed on the mesh, and what that is estimated to cost."""
    solution: Solution
    mesh: Mesh
    hardware: str
    fingerprint: str
    captured: Optional[CapturedGraph] = field(default=None, repr=False)
    #: how the model was built and planned when ``autoshard plan`` made it (spec, batch, seq, dtype,
    #: memory limit, optimizer): ``autoshard explain`` builds the same model again from it. JSON data.
    source: Optional[dict] = None

    # ---- the decisions -------------------------------------------------------------------------
    @property
    def param_placements(self) -> dict:
        """Parameter name (as in ``model.named_parameters()``, tied aliases included) -> tuple of
        placements, one per mesh axis (the storage placement each rank keeps)."""
        return dict(self.solution.param_placements)

    @property
    def strategies(self) -> dict:
        """Node name -> ``Strategy`` for every placeholder and op of the captured graph."""
        return dict(self.solution.strategies)

    @property
    def estimated_step_time(self) -> float:
        """Estimated seconds for one training step (forward, backward, gradient sync)."""
        return float(self.solution.estimated_step_time)

    @property
    def estimated_memory(self) -> int:
        """Estimated bytes on the busiest rank: parameters, gradients, optimizer state, activations."""
        return int(self.solution.estimated_memory)

    @property
    def replicated_ops(self) -> list:
        """Ops with no sharding rule, which therefore run replicated."""
        return list(self.solution.unruled_ops)

    # ---- reading it ---------------------------------------------------------------------------
    def summary(self) -> str:
        """A human-readable account: mesh, estimates, parameter placements, inserted collectives."""
        return plan_summary(self)

    def explain(self, name: str, **kwargs):
        """Why parameter or op ``name`` got its placement: the other strategies priced against the choice
        and the binding constraint (``autoshard.explain``; needs the captured graph)."""
        return explain(self, name, **kwargs)

    def to_dot(self) -> str:
        """The partition as graphviz dot text (needs the captured graph)."""
        return plan_to_dot(self)

    def render(self, path: str) -> str:
        """Draw the partition to ``path`` (.svg or .png). Without graphviz's ``dot`` program, writes
        ``path`` with suffix .dot instead and raises RuntimeError saying how to render it."""
        return render_dot(self.to_dot(), path)

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "mesh": self.mesh.to_json(),
            "hardware": self.hardware,
            "fingerprint": self.fingerprint,
            "solution": self.solution.to_json(),
            **({"source": self.source} if self.source is not None else {}),
        }

    def save(self, path: str) -> None:
        """Write the plan as JSON (never pickle)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanFormatError(f"not an autoshard plan: expected a JSON object with format={PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise PlanFormatError(
                f"plan version {data.get('version')!r} is not supported (this autoshard reads version {PLAN_VERSION})")
        try:
            return cls(
                solution=Solution.from_json(data["solution"]),
                mesh=Mesh.from_json(data["mesh"]),
                hardware=str(data["hardware"]),
                fingerprint=str(data["fingerprint"]),
                source=data.get("source"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFormatError(f"malformed plan: {e}") from e

    def attach(self, captured: CapturedGraph, mesh: Mesh) -> "Plan":
        """This plan bound to ``captured``; raises PlanFormatError if it was made for another graph/mesh."""
        if mesh.shape != self.mesh.shape:
            raise PlanFormatError(f"plan was made for mesh {self.mesh.shape}, not {mesh.shape}: plan again")
        fp = graph_fingerprint(captured)
        if fp != self.fingerprint:
            raise PlanFormatError(
                "plan was made for a different model or input shapes (graph fingerprint "
                f"{self.fingerprint} != {fp}): plan again for this model")
        return Plan(self.solution, self.mesh, self.hardware, self.fingerprint, captured, self.source)


def load_plan(path: str) -> Plan:
    """Read a plan written by ``Plan.save`` (JSON only; nothing is executed)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanFormatError(f"{path} is not valid JSON ({e}); was it written by Plan.save?") from e
    return Plan.from_json(data)


def describe_placements(pls) -> str:
    return fmt_placements(pls)
