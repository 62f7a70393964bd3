"""Solve: choose one strategy per op, minimizing estimated step time under the memory limit.

- ``clustering``: nodes of identical repeated blocks share one decision.
- ``strategy_graph``: the ILP's problem as plain data (``StrategyGraph``), follower folding, a greedy start.
- ``ilp``: the strategy-selection ILP on a ``StrategyGraph`` (OR-tools CP-SAT); knows nothing of torch.
- ``planner``: the sharding planner (build the problem from a captured program, solve it, price it).
- ``solution``: ``Solution``, the plan as plain data, priced by the cost model.
- ``microbatch``: one microbatch of the global batch (pipeline stages, gradient accumulation): its
  prices and the strategies still valid at its size.

May import: ortools, torch, the ``passes`` vocabulary, ``passes.sharding`` and ``passes.cost``.
"""
