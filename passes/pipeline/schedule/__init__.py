"""Pipeline schedules as data: ``Action(stage, kind, microbatch)`` lists per rank.

- ``actions``: the ``Action`` vocabulary (F, B, W, BW, ...).
- ``generators``: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev as action lists.
- ``simulate``: dry-run a schedule for step time, bubble, in-flight activations and deadlock.
- ``timeline``: an SVG timeline and Chrome trace JSON of a simulated step.

May import: the ``passes`` vocabulary only (no torch needed).
"""
