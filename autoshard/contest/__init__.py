"""Contest solvers: standalone programs for published strategy-graph problems, outside the compiler.

- ``iopddl/``: the IOPDDL contest solver (ASPLOS/EuroSys 2025 format), run by ``autoshard solve``.
  The planner never calls it; it shares the problem format with ``passes.solve.strategy_graph``.

May import: numpy, ortools, pytoulbar2 (optional) and ``autoshard.passes`` (the problem format and
errors). Nothing in ``passes`` or ``runtime`` imports it.
"""
