"""Cost: what a strategy costs in seconds and bytes per device.

- ``model``: the analytic cost model (``GraphFacts`` about a program, ``CostModel`` prices per node and
  per resharding edge, memory per rank).
- ``collectives``: seconds of one collective over one mesh axis, flat or across nodes.
- ``hardware``: ``Hardware`` (peaks, memory, links per axis) and its presets.
- ``profile_format``: the measured-profile JSON (what ``autoshard profile`` writes) and its fits.

May import: torch, numpy, the ``passes`` vocabulary.
"""
