"""Expert-parallel plans of the Hugging Face MoE models, trained on gloo ranks against one device.

    results = run_ranks(moe_worker, 4, [("mixtral", (4,), ("ep",))])
    results = run_moe(cases)        # the same, each model captured once for all ranks (``run_ranks(prepare=)``)
    failures, counts, summary, layers = results[0][0]

``roles`` names one ``moe_experts`` strategy per mesh axis (``ROLES``): "ep" (expert parallel, tokens
dispatched by all-to-all), "ep_local" (experts sharded, tokens replicated, no all-to-all), "dp"
(data parallel) or "tp" (tensor parallel inside each expert). ``expert_pins`` pins every MoE layer
of a capture to that combination; the solver places everything else. Each case is planned once, the
cases spread over the ranks (``shared_work.spread_over_ranks``); every rank compiles and trains next
to a single-device copy running the model's own (unfused) code (``equivalence.train_against_one_device``).
Each case returns ``(failures, collective counts of the rank's program, the plan's MoE summary lines,
the number of MoE layers in the capture)``.

A case may add a fourth item, a capacity factor (``set_moe_capacity_factor`` before capturing: the
static-shape formulation, ``expert_dispatch_capacity``; None: exact), and a fifth, the ``checkpoint``
lever to pin (``"full"``: every block's forward, all-to-alls included, runs again in the backward).
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch

from autoshard.passes.capture.moe_experts import set_moe_capacity_factor
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy
from autoshard.testing.equivalence import compiled_gradient_mismatches, train_against_one_device
from autoshard.testing.hf_zoo import build
from autoshard.testing.shared_work import spread_over_ranks
from autoshard.testing.zoo_check import TOL, sgd

__all__ = ["ROLES", "moe_nodes", "expert_pins", "moe_captures", "moe_worker", "prepared_moe_worker", "run_moe"]

_S0, _R, _P = Shard(0), Replicate(), Partial()
#: role -> (placements of hidden, index, weights, gate, up, down), output, lowering
ROLES = {
    "ep": ((_S0,) * 6, _S0, "expert_dispatch"),
    "ep_local": ((_R, _R, _R, _S0, _S0, _S0), _P, "expert_dispatch"),
    "dp": ((_S0, _S0, _S0, _R, _R, _R), _S0, None),
    "tp": ((_R, _R, _R, Shard(1), Shard(1), Shard(2)), _P, None),
}


def moe_nodes(captured: CapturedGraph) -> list[str]:
    """Names of the ``autoshard::moe_experts`` nodes of a capture, in program order."""
    return [n.name for n in captured.gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("autoshard.moe_experts")]


def expert_pins(captured: CapturedGraph, roles: Sequence[str], capacity: bool = False) -> dict:
    """``pins`` for ``plan_captured``: every MoE layer under ``roles`` (one per mesh axis); ``capacity``:
    the layers carry a capacity factor, so expert parallel lowers to ``expert_dispatch_capacity``."""
    per_axis = [ROLES[r] for r in roles]
    inputs = tuple(tuple(ax[0][i] for ax in per_axis) for i in range(6))
    lowerings = tuple(None if ax[2] is None else ax[2] + ("_capacity" if capacity else "") for ax in per_axis)
    strategy = Strategy(inputs, (tuple(ax[1] for ax in per_axis),), lowerings)
    return {"strategies": {name: strategy for name in moe_nodes(captured)}}


def moe_captures(cases: Sequence) -> dict:
    """``(model name, capacity factor) -> capture`` for every one the cases use: the checkpoint lever and the
    pins are the plan's, not the graph's."""
    from autoshard.passes.capture.export import capture

    torch.set_num_threads(1)
    captures = {}
    for name, _, _, *options in cases:
        factor = options[0] if options else None
        if (name, factor) not in captures:
            torch.manual_seed(0)
            model, inputs, target, loss_fn = build(name)
            set_moe_capacity_factor(model, factor)
            captures[name, factor] = capture(model, inputs, loss_fn=loss_fn, target=target)
    return captures


def run_moe(cases: Sequence, world: int = 4, *, steps: int = 2, time_limit_s: float = 10.0,
            timeout: float = 600.0) -> list:
    """``run_ranks(moe_worker, world, cases)``'s result, every model captured once (``moe_captures``, as
    ``run_ranks``' ``prepare``) in the process the ranks fork from, instead of on every rank."""
    import functools

    from autoshard.testing.ranks import run_ranks
    return run_ranks(prepared_moe_worker, world, cases, steps, time_limit_s, timeout=timeout,
                     prepare=functools.partial(moe_captures, list(cases)))


def moe_worker(rank: int, world: int, cases: Sequence, steps: int = 2, time_limit_s: float = 10.0) -> list:
    """Each ``(model name, mesh shape, roles)`` case on this rank: see the module docstring."""
    return prepared_moe_worker(rank, world, moe_captures(cases), cases, steps, time_limit_s)


def prepared_moe_worker(rank: int, world: int, captures: dict, cases: Sequence, steps: int = 2,
                        time_limit_s: float = 10.0) -> list:
    """``moe_worker`` with the cases' captures made (``moe_captures``, the same on every rank)."""
    from autoshard.api import plan_captured
    from autoshard.compiled import CompiledModel
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    jobs = []
    for name, mesh_shape, roles, *options in cases:
        factor = options[0] if options else None
        checkpoint = options[1] if len(options) > 1 else None
        captured = captures[name, factor]

        def solve(captured=captured, mesh=Mesh.of(mesh_shape), roles=roles, factor=factor, checkpoint=checkpoint):
            p = plan_captured(captured, mesh, hardware="cpu", pins=expert_pins(captured, roles, bool(factor)),
                              time_limit_s=time_limit_s, checkpoint=checkpoint)
            return {"plan": p.to_json(), "summary": [line for line in p.summary().splitlines() if "xpert" in line]}
        jobs.append(solve)
    planned = spread_over_ranks(jobs)  # every case planned once, the cases spread over the ranks
    out = []
    for (name, mesh_shape, roles, *options), outcome in zip(cases, planned):
        factor = options[0] if options else None
        checkpoint = options[1] if len(options) > 1 else None
        label = f"{name} mesh={mesh_shape} roles={roles} capacity_factor={factor} checkpoint={checkpoint}"
        torch.manual_seed(0)
        model, inputs, target, loss_fn = build(name)  # fresh weights every case (built in milliseconds)
        set_moe_capacity_factor(model, factor)
        captured = captures[name, factor]
        mesh = Mesh.of(mesh_shape)
        env = setup_distributed(mesh)
        got = outcome.value()
        plan = Plan.from_json(got["plan"]).attach(captured, mesh)
        cm = CompiledModel(model, plan, env)
        ref = copy.deepcopy(model)
        failures = train_against_one_device(
            label, cm, ref, (inputs, target), loss_fn=loss_fn, steps=steps, tol=TOL, optimizer=sgd,
            gradients=compiled_gradient_mismatches)
        out.append((failures, cm.collective_counts(), got["summary"], len(moe_nodes(captured))))
    return out
