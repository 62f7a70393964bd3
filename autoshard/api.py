"""The front door: ``plan`` (no process group needed) and ``compile`` (under torchrun).

>>> plan = autoshard.plan(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> print(plan.summary())
>>> cm = autoshard.compile(model, (2, 2), example_inputs=(x,), loss_fn=F.mse_loss, example_target=y)
>>> loss = cm.step(x, target=y); opt.step()
"""
from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.planner import plan_sharding, random_solution
from autoshard.passes.solve.solution import Solution
from autoshard.plans import Plan, graph_fingerprint

PIN_KEYWORDS = ("params", "inputs", "ops", "strategies")


def _pins(pins: dict) -> Optional[Pins]:
    unknown = sorted(set(pins) - set(PIN_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown keyword(s) {unknown}; pins are {list(PIN_KEYWORDS)}")
    given = {k: v for k, v in pins.items() if v}
    return Pins(**given) if given else None


def resolve_hardware(hardware):
    """``None``/"auto": the local accelerator's preset if it has one, else "cpu". Anything else (a preset
    name, a profile path, a ``Hardware`` object) passes through."""
    if hardware not in (None, "auto"):
        return hardware
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper()
        for preset in ("H200", "H100", "A100"):
            if preset in name:
                return preset.lower()
    return "cpu"


def hardware_label(hardware) -> str:
    """How a plan records its hardware: the preset or profile path, or a ``Hardware`` object's name."""
    return hardware if isinstance(hardware, str) else str(getattr(hardware, "name", "custom"))


def _plan_captured(captured, mesh: Mesh, *, hardware, memory_limit, optimizer, random_seed,
                   time_limit_s, pins: dict) -> Plan:
    hw = resolve_hardware(hardware)
    pin_obj = _pins(pins)
    if random_seed is not None:
        solution: Solution = random_solution(captured, mesh, seed=random_seed, pins=pin_obj)
    else:
        solution = plan_sharding(captured, mesh, hardware=hw, memory_limit=memory_limit, pins=pin_obj,
                                 optimizer=optimizer, time_limit_s=time_limit_s)
    return Plan(solution, mesh, hardware_label(hw), graph_fingerprint(captured), captured)


def plan(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
         hardware: Optional[str] = "auto", memory_limit: Optional[int] = None, optimizer: str = "adamw",
         random_seed: Optional[int] = None, time_limit_s: float = 30.0, **pins) -> Plan:
    """Trace ``model`` and choose how to shard it over ``mesh``; needs no process group.

    ``mesh``: an int, a tuple of ints, an ``autoshard.Mesh`` or a ``DeviceMesh``. ``example_inputs``:
    a tuple of tensors (or a dict of keyword tensors) holding one GLOBAL batch; meta tensors are fine
    and allocate nothing. ``loss_fn(output, target)`` with ``example_target`` makes the planned
    program a training step. ``hardware``: "a100" | "h100" | "h200" | "cpu" | a profile JSON path |
    "auto". ``memory_limit`` (bytes per device) overrides the preset's memory. Pins (each optional):
    ``params={"fc1.weight": ("S(0)", "R")}`` (fnmatch patterns), ``inputs={0: ("S(0)",)}``,
    ``ops={"linear_1": ("S(2)",)}``, ``strategies={node: Strategy}``. ``random_seed`` draws a random
    valid plan instead of solving (for testing the runtime).
    """
    mesh = Mesh.of(mesh)
    captured = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
    return _plan_captured(captured, mesh, hardware=hardware, memory_limit=memory_limit, optimizer=optimizer,
                          random_seed=random_seed, time_limit_s=time_limit_s, pins=pins)


def compile(model: torch.nn.Module, mesh: Any, *, example_inputs, loss_fn=None, example_target=None,
            plan: Optional[Plan] = None, state_dict: Optional[dict] = None, hardware: Any = "auto",
            memory_limit: Optional[int] = None, optimizer: str = "adamw", random_seed: Optional[int] = None,
            time_limit_s: float = 30.0, pp: Union[None, int, str] = None, schedule: Optional[str] = None,
            microbatches: Optional[int] = None, stages: Optional[list] = None, **pins):
    """Plan ``model`` for ``mesh`` and build this rank's program; call on every rank under torchrun.

    Rank 0 solves (unless ``plan`` is given) and broadcasts the plan as JSON, so every rank runs the
    same plan. Each rank materializes only its own shards: from ``model``'s real parameters, from
    ``state_dict`` (full tensors under the original names), or, for a meta-device model, by replaying
    each module's ``reset_parameters`` so values equal a CPU model built with the same seed.
    ``hardware``: a preset name, a profile JSON path, a ``Hardware`` object or "auto".
    Returns a ``CompiledModel``.

    Pipeline parallelism: ``pp="auto"`` lets the stage planner (``passes.pipeline.stages.planner.plan_pipeline``)
    choose the number of pipeline groups along the mesh's first axis, the stage cut, each group's
    (dp, tp) submesh, the microbatch count and the schedule; ``pp=N`` (N > 1) pins the number of
    groups and leaves the rest to it; ``schedule`` ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
    "zbv", "dualpipev"), ``microbatches`` and ``stages`` (module-name prefixes, node names or layer-unit
    indices where stages 1.. start) pin those decisions (``compiled.compile_pipeline``). The result is a
    ``PipelinedModel``, or a ``CompiledModel`` when the planner finds no pipeline faster (pp = 1).
    ``pp=None`` (default) or ``pp=1``: no pipeline, the plan above.
    """
    from autoshard.compiled import CompiledModel
    from autoshard.runtime.groups import broadcast_json, setup_distributed

    pipelined = _pipeline_degree(pp)
    if not pipelined and any(v is not None for v in (schedule, microbatches, stages)):
        raise TypeError("schedule=, microbatches= and stages= configure pipeline parallelism: pass pp='auto' "
                        "(or pp= > 1) too")
    if pipelined:
        bad = [k for k, v in (("plan", plan), ("random_seed", random_seed)) if v is not None]
        bad += [f"{k} (pins)" for k in ("inputs", "ops", "strategies") if pins.get(k)]
        if bad:
            raise TypeError(f"{', '.join(bad)} cannot be combined with pp={pp!r}: a pipeline is planned per stage "
                            "(only params= pins apply, to the stages holding those parameters)")
        _pins(pins)
    mesh = Mesh.of(mesh)
    env = setup_distributed(mesh)
    if pipelined:
        from autoshard.compiled import compile_pipeline
        return compile_pipeline(model, mesh, env, example_inputs=example_inputs, loss_fn=loss_fn,
                                example_target=example_target, pp=pp, schedule=schedule, microbatches=microbatches,
                                stages=stages, state_dict=state_dict, hardware=resolve_hardware(hardware),
                                memory_limit=memory_limit, optimizer=optimizer, time_limit_s=time_limit_s,
                                pins=pins)
    t0 = time.perf_counter()
    captured = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
    if plan is not None:
        chosen = plan.attach(captured, mesh)
        payload = None
    else:
        payload = None
        if env.rank == 0:
            chosen = _plan_captured(captured, mesh, hardware=hardware, memory_limit=memory_limit,
                                    optimizer=optimizer, random_seed=random_seed, time_limit_s=time_limit_s,
                                    pins=pins)
            payload = chosen.to_json()
        payload = broadcast_json(payload, src=0, env=env)
        chosen = Plan.from_json(payload).attach(captured, mesh)
    return CompiledModel(model, chosen, env, state_dict=state_dict, compile_seconds=time.perf_counter() - t0)


def _pipeline_degree(pp) -> bool:
    """Whether ``pp`` asks for pipeline planning: "auto" or an int > 1 (None and 1: no pipeline)."""
    if pp is None:
        return False
    if isinstance(pp, str):
        if pp != "auto":
            raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
        return True
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r}: pass pp='auto' (the planner chooses), an int >= 1, or None (no pipeline)")
    return pp > 1
