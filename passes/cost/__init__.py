"""Cost: what a strategy costs in seconds and bytes per device.

- ``facts``: ``GraphFacts`` about a program (node kinds, gradients, each op's work and launches).
- ``model``: ``CostModel``, the prices per node and per resharding edge, and memory per rank.
- ``collectives``: seconds of one collective over one mesh axis, flat or across nodes (which
  collectives a redistribution runs is ``passes.layout``, shared with the runtime).
- ``lowerings``: one ``Lowering`` descriptor per special lowering a rule may name, with its cost hooks
  (``attention``: ring attention's; ``moe``: expert dispatch's and the MoE op's own work).
- ``hardware``: ``Hardware`` (peaks, memory, links per axis) and its presets.
- ``profile_format``: the measured-profile JSON (what ``autoshard profile`` writes) and its fits.
- ``hardware_lookup``: ``get_hardware``, a ``hardware=`` argument (preset, JSON, profile) -> ``Hardware``.

May import: torch, numpy, the ``passes`` vocabulary, ``passes.capture`` (the saved-tensor analysis) and
``passes.sharding`` (the rules' lowering names and layouts).
"""
