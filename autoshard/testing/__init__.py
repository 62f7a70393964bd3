"""Shared test and benchmark support: the models, harnesses and helpers that ``tests/`` and
``benchmarks/`` import (installed with the package, so neither puts the other on ``sys.path``).

- ``models``: every shared model (MLPs, the GPT, a CNN, a U-Net, tiny Hugging Face configs) and
  builders returning a model with its example batch, target and loss.
- ``graphs``: captured training steps of those models on the meta device, for planner tests.
- ``corpus``: a generated character corpus, for benchmarks that train the GPT.
- ``ranks``: ``run_ranks(fn, n, ...)`` runs ``fn`` on n local gloo processes and collects the results.
- ``equivalence``: the one harness that trains a distributed program next to a single-device copy
  and lists every difference (loss each step, gradients, the full state dict at the end).
- ``levers``: for the memory-lever tests and benchmarks: batch makers, ZeRO-3 layouts, the one-device
  reference of gradient accumulation, wrappers that step twice or measure memory;
  ``memory_estimates``: one step per lever case measured next to the plan's estimate.
- ``rule_numerics``: checks every strategy a sharding rule claims against the unsharded op, with
  ``op_calls`` (a tiny function traced and its ATen calls recorded) and ``rank_simulation`` (n ranks
  of one mesh axis simulated in one process: split by placement, run, reassemble).
- ``hf_zoo``: tiny configs of Hugging Face models (``ZOO``: 21 of them), each with a batch and a loss;
  ``zoo_check``: runs them through autoshard on gloo ranks against one device, per architecture.
- ``custom_ops``: ``torch.library`` custom ops and a model calling them (``register_sharding``'s tests).
- ``svg_plot``: a dependency-free SVG line plot for benchmark figures.

May import: anything (the front door, ``autoshard.passes``, ``autoshard.runtime``, torch). Nothing in
the package imports it; only tests and benchmarks do. Importing this package imports none of its modules.
"""
