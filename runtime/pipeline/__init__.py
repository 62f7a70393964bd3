"""Pipeline parallelism in the runtime: the schedule interpreter over a program's stages, point-to-point
transfers, and zero-bubble split backward. The stages themselves are ``runtime.stage.LoweredStage``s and
the program is ``runtime.executor.RankProgram``, the same with or without a pipeline.

- the stage sub-programs come from ``passes.pipeline.stages.stage_graphs.split_stages`` (and a
  pipeline plan by hand from ``passes.pipeline.stages.by_hand``): the runtime plans nothing.
- ``groups``: each rank group's submesh communicators (``SubmeshEnv``) and shared-weight groups.
- ``boundaries``: the placement a value crosses stages at, the stages' strategies completed for what
  they receive, and the wiring of stages.
- ``p2p``: one transfer order derived from the schedule (``plan_transfers``) so every peer pair sends
  in the order the receiver posts (NCCL matches by order, not by tag).
- ``interpreter``: runs a rank group's action list, recording a measured timeline.
- ``split_backward`` / ``timelines``: zero-bubble B and W passes; measured timelines gathered from ranks,
  drawn and written as Chrome traces (``write_chrome_trace``).

May import: torch, ``autoshard.passes`` and the rest of ``autoshard.runtime``. Never the front door.
"""
