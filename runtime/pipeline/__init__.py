"""Pipeline-parallel runtime: per-stage programs, point-to-point transfers, the schedule interpreter.

- the stage sub-programs come from ``passes.pipeline.stages.stage_graphs.split_stages`` (and a
  pipeline plan by hand from ``passes.pipeline.stages.by_hand``): the runtime plans nothing.
- ``groups``: each rank group's submesh communicators (``SubmeshEnv``) and shared-weight groups.
- ``p2p``: replicated boundary layout; one transfer order derived from the schedule (``plan_transfers``)
  so every peer pair sends in the order the receiver posts (NCCL matches by order, not by tag).
- ``stage``: one stage's lowered program on its submesh and per-microbatch F / B / W / BW.
- ``interpreter``: runs a rank group's action list, recording a measured timeline.
- ``executor``: ``PipelineProgram`` (step / parameters / full_state_dict) and ``write_chrome_trace``.
- ``split_backward`` / ``timelines``: zero-bubble B and W passes; measured timelines gathered from ranks.

May import: torch, ``autoshard.passes`` and the rest of ``autoshard.runtime``. Never the front door.
"""
from .executor import PipelineProgram, write_chrome_trace  # noqa: F401

__all__ = ["PipelineProgram", "write_chrome_trace"]
