"""``PipelinePlan``: how a captured program is cut into pipeline stages and run on submeshes.

The physical mesh's FIRST axis is split among the pipeline's rank groups (``pp`` groups); each group
owns a contiguous block of ranks and runs its stages on a logical submesh (``StagePlan.mesh``, e.g.
(dp, tp) = (2, 2)) with the intra-op ``Solution`` the core planner chose for that stage's subgraph.
With virtual stages (interleaved 1F1B, ZBV, DualPipeV) rank group g owns several stages; stage s
lives on group ``stage_group[s]``.

Stage boundaries are given as node names of the captured graph: stage s holds the call_function
nodes in ``StagePlan.nodes`` (a topologically contiguous slice of the graph, in graph order). A value
produced in stage a and read in stage b > a is sent straight from a to b (no hop-by-hop relay).
Placeholders (params, buffers, inputs) belong to every stage that reads them; params are owned by
exactly one stage (the one that reads them; tied weights read in two stages are owned by the first
and their gradient is summed from the other — the runtime documents how it handles it).

Everything is JSON data (``to_json``/``from_json``), never pickle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.schedule.simulate import ScheduleError
from autoshard.passes.solve.solution import Solution


@dataclass
class StagePlan:
    """One pipeline stage: its ops, its rank group, that group's logical submesh, and its sharding."""
    index: int
    nodes: list[str]
    group: int
    ranks: list[int]
    mesh: Mesh
    solution: Optional[Solution] = None
    recompute: bool = False

    def to_json(self) -> dict:
        return {"index": self.index, "nodes": list(self.nodes), "group": self.group, "ranks": list(self.ranks),
                "mesh": self.mesh.to_json(), "recompute": self.recompute,
                "solution": None if self.solution is None else self.solution.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "StagePlan":
        return cls(int(d["index"]), list(d["nodes"]), int(d["group"]), [int(r) for r in d["ranks"]],
                   Mesh.from_json(d["mesh"]), None if d.get("solution") is None else Solution.from_json(d["solution"]),
                   bool(d.get("recompute", False)))


@dataclass
class PipelinePlan:
    """Stages, schedule and microbatching for a pipeline-parallel program.

    ``pp``: number of rank groups; ``virtual``: stages per group (1 unless interleaved/V schedules);
    ``stages``: ``pp * virtual`` StagePlans in pipeline order; ``schedule``: a name the schedule
    registry knows (``schedule/registry.py``), whose stages per rank must be ``virtual``;
    ``microbatches``: how many microbatches the global batch is cut into (along dim 0 of every input
    and the target). Estimates come from the schedule simulator.
    """
    pp: int
    virtual: int
    stages: list[StagePlan]
    schedule: str
    microbatches: int
    estimated_step_time: float = 0.0
    bubble_fraction: float = 0.0
    peak_activation_memory: list[float] = field(default_factory=list)

    def __post_init__(self):
        try:
            desc = get_schedule(self.schedule)
        except ScheduleError as err:
            raise ValueError(str(err)) from None
        if desc.virtual_stages != self.virtual:
            raise ValueError(f"schedule {self.schedule!r} runs {desc.virtual_stages} stage(s) per rank group, but the "
                             f"plan says virtual={self.virtual}")
        if len(self.stages) != self.pp * self.virtual:
            raise ValueError(f"{len(self.stages)} stages but pp * virtual = {self.pp} * {self.virtual} = "
                             f"{self.pp * self.virtual}")

    def to_json(self) -> dict:
        return {"pp": self.pp, "virtual": self.virtual, "stages": [s.to_json() for s in self.stages],
                "schedule": self.schedule, "microbatches": self.microbatches,
                "estimated_step_time": self.estimated_step_time, "bubble_fraction": self.bubble_fraction,
                "peak_activation_memory": list(self.peak_activation_memory)}

    @classmethod
    def from_json(cls, d: dict) -> "PipelinePlan":
        return cls(int(d["pp"]), int(d["virtual"]), [StagePlan.from_json(s) for s in d["stages"]], str(d["schedule"]),
                   int(d["microbatches"]), float(d.get("estimated_step_time", 0.0)),
                   float(d.get("bubble_fraction", 0.0)), [float(x) for x in d.get("peak_activation_memory", [])])
