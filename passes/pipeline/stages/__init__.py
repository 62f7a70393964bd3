"""The stage planner: where to cut a program into pipeline stages, on which submeshes, with how many
microbatches, which schedule and which stages recompute.

- ``layer_costs``: the program as a chain of layer units, priced per unit on a (dp, tp) submesh (per
  microbatch through ``passes.solve.microbatch``).
- ``stage_problem``: one configuration to cut (``StageProblem``) and the closed-form price of a cut;
  ``stage_cuts``: the balanced and even cuts and the least memory a cut needs, without a solver;
  ``stage_ilp``: contiguous stage ranges and per-stage recompute as a CP-SAT ILP.
- ``scoring`` / ``search``: score a configuration with the schedule simulator; search the candidates.
- ``planner``: ``plan_pipeline``, the entry point: a ``passes.pipeline.plan.Plan``.
- ``retrace``: a plan moved onto the program traced at the microbatch size, and re-solved there.

May import: the ``passes`` vocabulary, ``passes.cost``, ``passes.solve``, ``passes.pipeline.schedule``.
"""
