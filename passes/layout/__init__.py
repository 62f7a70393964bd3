"""Layout arithmetic: where a placed tensor's pieces lie, how one placement becomes another, and
which parameter copies travel fused. The cost model prices it and the runtime executes it, so each
rule exists here once and both sides call it:

- ``shapes``: local shapes and offsets of a sharded tensor, and whether a placement divides a shape;
- ``redistribution``: placement codes and the steps (one collective or local op per mesh axis) that
  take a tensor from one placement to another;
- ``gathers``: which parameter gathers are fused into one flat collective (and so prefetched), and
  how gathers are grouped into segments.

May import: torch and the ``passes`` vocabulary (``errors``, ``mesh``, ``spec``). Part of the
vocabulary itself: every stage and the runtime may import it; it imports no stage.
"""
