"""Capture: a model and one example batch become a ``CapturedGraph`` (``passes.graph``).

- ``export``: ``capture(model, example_inputs, loss_fn=, target=)`` and the program wrapper it traces;
  ``set_graph_device``.
- ``normalize``: the exported graph -> the ``CapturedGraph`` contract (parameters, buffers, inputs and
  target as placeholders; tied tensors; module paths and metadata on every node).
- ``saved``: what autograd keeps for the backward, per node (a meta-device run of the program).
- ``tracers``: run ``torch.export`` (non-strict), fall back to ``torch.fx.symbolic_trace``, and turn a
  tracer's failure into a ``TraceError`` that names the construct and where it is.

May import: torch, the ``passes`` vocabulary (errors, graph, spec).
"""
