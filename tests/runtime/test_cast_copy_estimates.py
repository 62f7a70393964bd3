"""Mixed precision's cast-only parameter copies, measured against the plan's estimate.

Under data parallelism every parameter is stored as its ops read it, so no collective moves it;
with ``param_dtype=bf16`` the runtime's gatherer still makes (and holds) a bf16 copy of each. The
plan must price those copies as gathered parameter copies (``gathered_peak_bytes``), not as saved
activations: on 2 gloo ranks, ``runtime.memory_probe`` measures both figures, which must be
within 10% of ``solution.evaluate``'s on every rank (the 10% bound of test_memory_estimates).
"""
from __future__ import annotations

import torch

from autoshard.testing.ranks import run_ranks
from autoshard.passes.solve.context import PlanContext

MESH = (2,)


def cast_copies_worker(rank: int, world: int) -> tuple:
    from autoshard import presets
    from autoshard.api import plan_captured
    from autoshard.passes.capture.export import capture
    from autoshard.passes.levers import Levers, MixedPrecision
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.groups import setup_distributed
    from autoshard.testing.levers import MICRO, Probed, build

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(MICRO, 0)
    mp = MixedPrecision(torch.bfloat16)
    captured = capture(model, inputs, loss_fn=loss_fn, target=target, param_dtype=torch.bfloat16)
    env = setup_distributed(Mesh.of(MESH))
    strategies = plan_captured(captured, Mesh.of(MESH), hardware="cpu", time_limit_s=20, mixed_precision=mp,
                               pins=presets.data_parallel(MESH)).solution.strategies
    levers = Levers(mixed_precision=mp)
    probed = Probed(RankProgram.of_strategies(captured, strategies, MESH, env=env, model=model, levers=levers))
    probed.step(*inputs, target=target)
    est = evaluate(captured, Mesh.of(MESH), strategies, PlanContext.of("cpu", optimizer="adamw"),
                   levers=levers).estimated
    return probed.measured["saved"], est["saved_activation_bytes"], probed.measured["gathered"], est["gathered_peak_bytes"]


def test_cast_only_copies_are_priced_as_the_gathered_copies_they_are():
    for rank, (saved, saved_est, gathered, gathered_est) in enumerate(run_ranks(cast_copies_worker, MESH[0])):
        assert gathered > 0, "no cast copy was made: the case tests nothing"
        assert abs(gathered - gathered_est) <= 0.10 * gathered_est, (rank, gathered, gathered_est)
        assert abs(saved - saved_est) <= 0.10 * saved_est, (rank, saved, saved_est)
