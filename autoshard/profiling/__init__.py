"""Measure the machine a plan will run on, for the cost model (``autoshard profile``).

- ``measure``: what to measure, the machine record, and the driver (every rank of a world, or local
  processes it spawns); the result is a profile (``passes.cost.profile_format``).
- ``local_work``: matmul, copy, elementwise and per-op launch timings.
- ``collectives``: collective latency/bandwidth per group size, alternating over a 2-D mesh's axes.
- ``timer``: the slowest rank's median seconds per call, every rank timed together.
- ``cli``: the ``autoshard profile`` command.

May import: torch, ``autoshard.passes`` and ``autoshard.runtime.groups`` (device and backend choice).
"""
