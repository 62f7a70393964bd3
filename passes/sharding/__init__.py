"""Sharding: the ways each op of a captured program may be split over a mesh.

- ``rules/``: one registry of sharding rules keyed by ATen op, one module per op family; a rule gives
  the 1-D options of one op on one mesh axis.
- ``strategies``: the multi-axis strategies of every node (product over axes, filtered by divisibility).
- ``pins``: the user's manual decisions (parameter, input and op placements) resolved to strategy indices.

May import: torch, the ``passes`` vocabulary, and ``passes.capture`` types.
"""
