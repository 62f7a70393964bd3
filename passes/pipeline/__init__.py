"""Pipeline parallelism as data.

- ``schedule/``: a schedule is data (``Action`` lists per rank), its generators, the simulator that
  dry-runs it for time, memory and deadlock, and pictures of a simulated timeline.
- ``stages/``: the stage planner: layer units and their costs per submesh, microbatch facts, the stage
  ILP, the search over (pp, submesh, microbatches, schedule, recompute) and ``PipelinePlan``.

May import: the ``passes`` vocabulary, ``passes.solve`` and the stages before it.
"""
