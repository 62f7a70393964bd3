"""Measure the machine a plan will run on, for the cost model (``autoshard profile``).

- ``measure``: matmul, memory and per-op launch timings, and collective latency/bandwidth per group
  size, on every rank of a world; the result is a profile (``passes.cost.profile_format``).
- ``cli``: the ``autoshard profile`` command.

May import: torch, ``autoshard.passes`` and ``autoshard.runtime.groups`` (device and backend choice).
"""
