"""Pipeline schedules as data: ``Action(stage, kind, microbatch)`` lists per rank.

- ``actions``: the ``Action`` vocabulary (F, B, W, BW, ...).
- ``registry``: one ``Schedule`` descriptor per schedule (placement, virtual stages, validity, order).
- ``orders``: each schedule's compute order (gpipe, 1f1b, interleaved-1f1b[-vN], zb-h1, zbv, dualpipev).
- ``generators``: ``generate(name, p, m)``: the order plus its SEND/RECV pairs, as action lists.
- ``simulate``: dry-run a schedule for step time, bubble, in-flight activations and deadlock.
- ``timeline``: an SVG timeline and Chrome trace JSON of a simulated step.

May import: the ``passes`` vocabulary only (no torch needed).
"""
