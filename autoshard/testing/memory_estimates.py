"""Measured memory next to the plan's estimate, per lever case, on one rank (run it on every rank).

``memory_against_estimates(rank, models, cases)``: for each lever test model (``levers.build``) and
mesh, the ZeRO-3 layout ``levers.planned`` gives, and each lever case ``(name, accumulation,
checkpoint, reshard_after_forward)``, one step measured by ``runtime.memory_probe`` next to
``solution.evaluate``'s ``estimated`` for the same strategies and levers. Returns rows
``(model, mesh, case, saved, saved_estimated, gathered_peak, gathered_peak_estimated)``.
Used by ``tests/runtime/test_memory_estimates.py`` and ``benchmarks/memory_estimates.py``.
"""
from __future__ import annotations

import torch

from .levers import BLOCK_TYPES, MICRO, Probed, build, planned

__all__ = ["LEVER_CASES", "memory_against_estimates"]

#: (name, accumulation, checkpoint, reshard after forward): every lever, alone and combined
LEVER_CASES = (("none", 1, "none", False), ("selective + reshard", 1, "selective", True), ("full", 1, "full", False),
               ("acc 2 + full + reshard", 2, "full", True), ("acc 4 + selective", 4, "selective", False),
               ("acc 2 + reshard", 2, "none", True))


def memory_against_estimates(rank: int, models, cases=LEVER_CASES) -> list[tuple]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.levers import BlockPolicy, Levers
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    rows = []
    for model_name, meshes in models:
        torch.manual_seed(0)
        model, batch, loss_fn, layers = build(model_name)
        inputs, target = batch(MICRO, 0)
        captured = capture(model, inputs, loss_fn=loss_fn, target=target)
        for mesh_shape in meshes:
            env = setup_distributed(Mesh.of(mesh_shape))
            strategies = planned(captured, model, mesh_shape, layers, rank, env)
            for case, k, checkpoint, reshard in cases:
                levers = Levers(k, {BLOCK_TYPES[model_name]: BlockPolicy(checkpoint, reshard)})
                probed = Probed(RankProgram(captured, strategies, mesh_shape, env=env, model=model, levers=levers))
                x, y = batch(MICRO * k, 1)
                probed.step(**x, target=y) if isinstance(x, dict) else probed.step(*x, target=y)
                est = evaluate(captured, Mesh.of(mesh_shape), strategies, "cpu", "adamw", levers=levers,
                               traced_at_microbatch=True).estimated
                rows.append((model_name, str(mesh_shape), case, probed.measured["saved"],
                             est["saved_activation_bytes"], probed.measured["gathered"], est["gathered_peak_bytes"]))
    return rows
