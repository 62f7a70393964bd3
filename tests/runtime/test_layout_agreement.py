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
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.layout.redistribution import COMMUNICATING
from autoshard.passes.levers import MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.clustering import OUTPUT
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.random_plans import random_solution
from autoshard.passes.solve.solution import pricing_for
from autoshard.passes.spec import Partial
from autoshard.runtime.groups import MeshEnv
from autoshard.runtime.lower import COLLECTIVE_META, PARAM_STEPS_META, lower
from autoshard.testing import models
from autoshard.passes.solve.context import PlanContext

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
        solution = random_solution(captured, mesh, PlanContext.of("cpu"), seed=seed, levers=LeverPins.off())
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
        solution = random_solution(captured, mesh, PlanContext.of("cpu"), seed=seed, levers=LeverPins(accumulation=1))
        program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
        assert _timeline_groups(solution) == _runtime_groups(program), seed


def test_gather_groups_agree_with_cast_only_copies():
    """Mixed precision: a parameter stored as its op needs it is still copied (cast), unfused."""
    captured, _ = _capture("gpt", param_dtype=torch.bfloat16)
    mesh = Mesh.of((2, 2))
    levers = LeverPins.off(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    unfused = 0
    for seed in SEEDS:
        solution = random_solution(captured, mesh, PlanContext.of("cpu"), seed=seed, levers=levers)
        program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
        want = _runtime_groups(program)
        assert _timeline_groups(solution) == want, seed
        unfused += sum(not fused for group in want for _, fused in group)
    assert unfused, "no cast-only copy: the case tested nothing new"


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
def test_collectives_priced_are_the_collectives_called(name):
    """Per plan: the forward collectives the plan prices are the program's collective calls,
    counted by kind: every redistribution (activations, parameter copies and the program's output
    alike; the runtime makes one copy per (producer, placement) that every reader shares, and the
    plan lists its collectives once, at the first reader) and every special lowering's own
    collectives (``loss_mean_partial``'s total-weight all-reduce, ``batch_norm_sync``'s statistics)."""
    captured, _ = _capture(name)
    lowered = 0
    for shape in ((2, 2), (4,)):
        mesh = Mesh.of(shape)
        facts, cm = pricing_for(captured, mesh, get_hardware("cpu"), "adamw", 1)
        for seed in SEEDS:
            solution = random_solution(captured, mesh, PlanContext.of("cpu"), seed=seed, levers=LeverPins.off())
            program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
            ran: Counter = Counter()
            for node in program.graph.nodes:
                if COLLECTIVE_META in node.meta:
                    ran[node.meta[COLLECTIVE_META]] += 1
                ran.update(k for k in node.meta.get(PARAM_STEPS_META, ()) if k in COMMUNICATING)
            priced: Counter = Counter()
            for move in solution.redistributions:
                priced.update(c.kind for c in move.collectives if c.phase == "fwd")
            for op, strategy in solution.strategies.items():
                if facts.kind[op] == "op" and any(strategy.lowerings):
                    own = [c.kind for c in cm.price_node(op, strategy, facts).collectives if c.phase == "fwd"]
                    priced.update(own)
                    lowered += len(own)
            assert {k: priced[k] for k in COMMUNICATING} == {k: ran[k] for k in COMMUNICATING}, (shape, seed)
    if name == "cnn":
        assert lowered, "no plan priced a lowering's collective: the comparison saw none"


def test_loss_output_is_priced_as_the_program_returns_it():
    """The program returns a loss as ``P`` (the caller sums the ranks' values): the plan prices that
    edge as the move to ``P`` on every axis, which communicates nothing, not an all-reduce to ``R``."""
    captured, _ = _capture("gpt")
    mesh = Mesh.of((2, 2))
    for seed in SEEDS:
        solution = random_solution(captured, mesh, PlanContext.of("cpu"), seed=seed, levers=LeverPins.off())
        out = [m for m in solution.redistributions if m.consumer == OUTPUT]
        assert all(m.dst == (Partial(), Partial()) and not m.collectives for m in out), (seed, out)


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_fused_parameter_gathers_are_priced_as_the_flat_collectives_run(shape):
    """The runtime gathers a segment's fused parameter copies in one flat all-gather (and reduces
    their gradients in one flat reduce-scatter) per (mesh axes, dtype): with every collective
    costing a fixed 1 ms, the step's communication is the per-parameter moves' less 1 ms for each
    call the flat collectives save, counted from the lowered program's gather groups."""
    import dataclasses
    from autoshard.passes.cost.hardware import COLLECTIVE_KINDS
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.solve.planner import plan_sharding

    captured, _ = _capture("gpt")
    mesh = Mesh.of(shape)
    fits = tuple((k, n, 1e-3, 0.0) for k in COLLECTIVE_KINDS for n in (2, 4))
    hw = dataclasses.replace(get_hardware("cpu"), collective_fits=fits, op_overhead_s=0.0, devices_per_node=4)
    pins = Pins(params={"*": ("S(0)",) * len(shape)}, inputs={0: ("S(0)",) + ("R",) * (len(shape) - 1)})
    solution = plan_sharding(captured, mesh, PlanContext.of(hw), pins=pins, levers=LeverPins.off())
    program = lower(captured, solution.strategies, MeshEnv.offline(mesh, rank=0), solution.levers)
    members = flat = 0
    for group in program.param_gatherer.groups:
        sets = {(m.fused_gather()[0], m.dtype) for m in group.members if m.fused_gather() is not None}
        flat += len(sets)
        # each member's own move is one collective per phase (one over its axes flattened)
        members += sum(1 for m in group.members if m.fused_gather() is not None)
    assert members > flat > 0, "no fused set of several members: the case tests nothing"
    facts, cm = pricing_for(captured, mesh, hw, "adamw", 1)
    per_move = sum(c.seconds for move in solution.redistributions for c in move.collectives)
    own = sum(c.seconds for op, s in solution.strategies.items() if facts.kind[op] == "op" and any(s.lowerings)
              for c in cm.price_node(op, s, facts).collectives)
    saved_calls = 2 * (members - flat)  # forward gathers and backward reduce-scatters alike
    assert solution.time_breakdown["communication"] == pytest.approx(per_move + own - saved_calls * 1e-3, abs=1e-9)
