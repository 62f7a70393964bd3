"""Capture: a model and one example batch become a ``CapturedGraph`` (``passes.graph``).

- ``export``: ``capture(model, example_inputs, loss_fn=, target=)``, the program wrapper, normalization
  of the exported graph (parameters, buffers, inputs and target as placeholders; module paths).
- ``tracers``: run ``torch.export`` (non-strict), fall back to ``torch.fx.symbolic_trace``, and turn a
  tracer's failure into a ``TraceError`` that names the construct and where it is.

May import: torch, the ``passes`` vocabulary (errors, graph, spec).
"""
