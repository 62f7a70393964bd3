"""The planner prices what the runtime runs: the parameter gather groups the memory timeline
prices (``Solution.gather_groups``) are the groups the lowered program gathers
(``ParamGatherer.groups``), member for member and fused or not, and every redistribution the plan
prices is the collectives the program calls. Both sides take the arithmetic from
``passes.layout``; these tests catch a caller that drifts (a different segment rule, a copy the
timeline misses, a step priced but not run). One process, offline mesh, a few seconds."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.layout.redistribution import COMMUNICATING
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.levers import MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.clustering import OUTPUT
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import random_solution
from autoshard.runtime.groups import MeshEnv
from autoshard.runtime.lower import COLLECTIVE_META, MOVE_META, PARAM_STEPS_META, lower
from autoshard.testing import models

CASES = [("gpt", (2, 2)), ("gpt", (4,)), ("gpt", (2, 1, 2)), ("mlp", (2, 2)), ("cnn", (2, 2))]
SEEDS = range(6)


def _capture(name: str, param_dtype=None):
    torch.manual_seed(0)
    model, inputs, target, loss = {"gpt": lambda: models.gpt(n_layer=3), "mlp": models.mlp, "cnn": models.cnn}[name]()
    return capture(model, inputs, loss_fn=loss, target=target, param_dtype=param_dtype), model


def _runtime_groups(program) -> list:
    gatherer = getattr(program, "param_gatherer", None)
    if gatherer is None:
        return []
    return [sorted((m.placeholder, m.fused_gather() is not None) for m in g.members) for g in gatherer.groups]


def _timeline_groups(solution) -> list:
    return [sorted((param, fused) for param, _, fused in g) for g in solution.gather_groups]


@pytest.mark.parametrize("name,mesh", CASES)
def test_gather_groups_priced_are_the_groups_run(name, mesh):
    captured, _ = _capture(name)
    mesh = Mesh.of(mesh)
    gathered = 0
    for seed in SEEDS:
        solution = random_solution(captured, mesh, seed=seed, hardware="cpu", levers=LeverPins.off())
        program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
        want = _runtime_groups(program)
        assert _timeline_groups(solution) == want, (name, mesh.shape, seed)
        gathered += len(want)
    assert gathered, "no plan gathered a parameter: the comparison saw nothing"


def test_gather_groups_agree_under_random_levers():
    """Reshard-after-forward and checkpointing change which groups regather, not how they group."""
    captured, _ = _capture("gpt")
    mesh = Mesh.of((2, 2))
    for seed in SEEDS:
        solution = random_solution(captured, mesh, seed=seed, hardware="cpu", levers=LeverPins(accumulation=1))
        program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
        assert _timeline_groups(solution) == _runtime_groups(program), seed


@pytest.mark.xfail(strict=True, reason=(
    "known disagreement: under mixed precision the runtime makes, and groups, a cast-only copy of a "
    "parameter whose placement needs no collective; the timeline prices that copy as a kept activation "
    "(LeverPricer._price: 'gathered' needs forward communication), not as a gather. Without the cast-only "
    "members the groups agree on every seed here. Aligning them changes mixed-precision memory estimates."))
def test_gather_groups_agree_with_cast_only_copies():
    """Mixed precision: a parameter stored as its op needs it is still copied (cast), unfused."""
    captured, _ = _capture("gpt", param_dtype=torch.bfloat16)
    mesh = Mesh.of((2, 2))
    levers = LeverPins.off(MixedPrecision(param_dtype=torch.bfloat16))
    unfused = 0
    for seed in SEEDS:
        solution = random_solution(captured, mesh, seed=seed, hardware="cpu", levers=levers)
        program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
        want = _runtime_groups(program)
        assert _timeline_groups(solution) == want, seed
        unfused += sum(not fused for group in want for _, fused in group)
    assert unfused, "no cast-only copy: the case tested nothing new"


def test_redistributions_priced_are_the_collectives_called():
    """Per plan: the forward collectives of the priced redistributions (activations and parameter
    copies alike) are the program's collective calls, counted by kind. The runtime moves a value
    once per (producer, placement) and every reader needing that placement shares the copy, so the
    priced moves are counted once per (producer, placement) too (the cost model prices each reading
    edge; a second reader of the same copy is charged again). The loss leaves the program as ``P``
    (the caller sums it), where the cost model prices it gathered to ``R``: that edge is left out,
    and so are an op lowering's own collectives (``MOVE_META`` marks a redistribution's)."""
    captured, _ = _capture("gpt")
    for shape in ((2, 2), (4,)):
        mesh = Mesh.of(shape)
        for seed in SEEDS:
            solution = random_solution(captured, mesh, seed=seed, hardware="cpu", levers=LeverPins.off())
            program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
            ran: Counter = Counter()
            for node in program.graph.nodes:
                if node.meta.get(MOVE_META):
                    ran[node.meta[COLLECTIVE_META]] += 1
                ran.update(k for k in node.meta.get(PARAM_STEPS_META, ()) if k in COMMUNICATING)
            priced: Counter = Counter()
            once = {(m.producer, normalize(m.dst, mesh.shape)): m for m in solution.redistributions
                    if m.consumer != OUTPUT}
            for move in once.values():
                priced.update(c.kind for c in move.collectives if c.phase == "fwd")
            assert {k: priced[k] for k in COMMUNICATING} == {k: ran[k] for k in COMMUNICATING}, (shape, seed)
