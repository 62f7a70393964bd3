"""Solve: choose one strategy per op, minimizing estimated step time under the memory limit.

- ``clustering``: nodes of identical repeated blocks share one decision.
- ``strategy_graph``: the ILP's problem as plain data (``StrategyGraph``), follower folding, a greedy start.
- ``ilp``: the strategy-selection ILP on a ``StrategyGraph`` (OR-tools CP-SAT); knows nothing of torch.
- ``problem``: ``ShardingProblem``, one program on one mesh as the ILP sees it (strategies, pins, clusters).
- ``planner``: the sharding planner (memory levers included: search the microstep counts, solve, price).
- ``solution``: ``Solution``, the plan as plain data, priced by the cost model (``evaluate``).
- ``microbatch``: one microbatch of the global batch (pipeline stages, gradient accumulation): its
  prices and the strategies still valid at its size.
- ``blocks``: which repeated-block instance each node belongs to, and what leaves each block.
- ``lever_costs``: prices of nodes and edges under a block type's checkpoint / reshard policy.
- ``lever_graph``: the ILP's problem with every block op's strategies expanded by its type's policies.
- ``lever_pins``: ``LeverPins``, which levers the planner chooses and which the user fixed.

May import: ortools, torch, the ``passes`` vocabulary, ``passes.capture``, ``passes.sharding`` and
``passes.cost``.
"""
