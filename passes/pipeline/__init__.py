"""Pipeline parallelism as data, and the plan: every plan is a list of stages, one without a pipeline.

- ``plan``: ``Plan`` (its stages, each with its intra-op ``Solution`` and levers, under a schedule)
  and ``Stage``; ``plan_file``: a plan on disk (JSON, older versions read); ``plan_work``: what its
  step time means (tokens per second, MFU).
- ``schedule/``: a schedule is data (``Action`` lists per rank), its generators, the simulator that
  dry-runs it for time, memory and deadlock, and pictures of a simulated timeline.
- ``stages/``: the stage planner: layer units and their costs per submesh, microbatch facts, the stage
  ILP, the search over (pp, submesh, microbatches, schedule, recompute), and moving a plan onto the
  program traced at the microbatch size.

May import: the ``passes`` vocabulary, ``passes.solve`` and the stages before it.
"""
