"""Analysis: an ``nn.Module`` in, a sharding plan out. Pure functions over an fx graph; no process group.

The stages, in the order a plan is made::

    capture/     model + example batch -> CapturedGraph (ATen-level fx program, shapes and module paths)
    sharding/    the ways each op may be split: rules per op family, multi-axis strategies, user pins
    cost/        what a strategy costs: the analytic model, collective formulas, hardware, measured profiles
    solve/       the choice: clustering of repeated blocks, the ILP, the sharding planner, the Solution
    pipeline/    stages and schedules: schedule/ (actions, generators, simulator), stages/ (the stage planner)

Loose files are the vocabulary every stage shares: ``errors``, ``mesh``, ``spec`` (placements and
strategies), ``graph`` (the captured program), ``schema`` (an op call's arguments bound to its schema
names), ``units`` (human-readable bytes and seconds), and so is ``layout/`` (local shapes,
redistribution steps and parameter-gather fusion: the arithmetic the cost model prices and the
runtime runs, written once).

May import: torch, numpy, ortools, and itself. Never ``autoshard``'s front door or ``autoshard.runtime``.
Within ``passes``, a stage imports the vocabulary and the stages before it, never one after it.
The IOPDDL contest solver, which the planner never calls, lives outside the stages (``autoshard.contest``).
"""
