"""A standalone solver for the IOPDDL strategy-graph problem (the ASPLOS/EuroSys 2025 contest format).

It is the sharding problem in its contest form: one strategy per node, resharding costs on edges,
and a memory limit over time. ``autoshard solve`` runs it; the sharding planner solves its own
problems with ``passes.solve.ilp`` and shares only the problem format (``problem.from_strategy_graph``).

- ``problem``: reading, writing and verifying IOPDDL problems.
- ``presolve``: exact reductions and the compact ``Core`` the search works on.
- ``local_search``: a state with memory load per time point, greedy starts and ICM moves.
- ``wcsp``: the priced, memory-free problem as a cost-function network solved by toulbar2.
- ``penalties``: memory as adaptive per-node penalties; the Lagrangian lower bound.
- ``segment_tree`` / ``chain_moves``: range add / range max over time; chain (ejection) moves.
- ``pool`` / ``pool_search``: a pool of answers, recombination, the search each process runs.
- ``parallel``: forked workers and the incumbent they share.
- ``belief_propagation`` / ``lagrangian`` / ``lns``: the search without toulbar2 (min-sum belief
  propagation with per-time-point prices and repair; forest moves and CP-SAT neighbourhoods).
- ``forest_moves``: exact block moves on random induced forests (dynamic programming).
- ``regions`` / ``neighbourhood_search``: neighbourhoods re-solved exactly with CP-SAT.
- ``solver``: ``solve_problem``, which runs the phases under a deadline.

May import: numpy, ortools, pytoulbar2 (optional), ``passes.errors`` and
``passes.solve.strategy_graph`` (for the format conversion).
"""
