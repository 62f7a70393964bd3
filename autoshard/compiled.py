"""``CompiledModel``: what ``autoshard.compile`` returns on each rank.

It owns this rank's program (a printable fx GraphModule of local ops and explicit collectives) and
its local parameter shards. ``step`` runs forward and backward over the global batch and leaves the
synchronized local gradients on ``parameters()``, which any ``torch.optim`` optimizer takes.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from autoshard.plan import Plan


class CompiledModel:
    def __init__(self, model: torch.nn.Module, plan: Plan, env, *, state_dict: Optional[dict] = None,
                 compile_seconds: float = 0.0):
        from autoshard.runtime.executor import RankProgram

        self.plan = plan
        self.env = env
        self.compile_seconds = compile_seconds
        self._program = RankProgram(plan.captured, plan.solution.strategies, plan.mesh, env=env,
                                    model=model, state_dict=state_dict)

    # ---- running -------------------------------------------------------------------------------
    def step(self, *inputs, target=None, **named_inputs) -> float:
        """Forward and backward over the GLOBAL batch (the same full tensors on every rank); returns the
        mean loss, identical on every rank. Gradients land on ``parameters()``. Inputs traced as keywords
        (``example_inputs={"input_ids": ...}``) may be passed by name."""
        return self._program.step(*self._ordered(inputs, named_inputs), target=target)

    def __call__(self, *inputs, target=None, **named_inputs):
        """Forward only, no autograd: the full (gathered) output on every rank, or, for a program traced
        with a loss function, the mean loss (pass ``target=``)."""
        return self._program.forward(*self._ordered(inputs, named_inputs), target=target)

    def _ordered(self, inputs: tuple, named: dict) -> tuple:
        if not named:
            return inputs
        order = [n for n in self.plan.captured.inputs if n != self.plan.captured.target]
        unknown = sorted(set(named) - set(order))
        if unknown:
            from autoshard.passes.errors import BatchError
            raise BatchError(f"unknown input name(s) {unknown}; the program was traced with inputs {order}")
        positional = list(inputs)
        for name in order[len(positional):]:
            if name not in named:
                from autoshard.passes.errors import BatchError
                raise BatchError(f"input {name!r} is missing; the program was traced with inputs {order}")
            positional.append(named[name])
        return tuple(positional)

    # ---- state -----------------------------------------------------------------------------------
    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's local parameter shards (pass them to a torch.optim optimizer)."""
        return iter(self._program.parameters())

    def named_parameters(self):
        return iter(self._program.named_parameters())

    def full_state_dict(self) -> dict:
        """Full tensors under the original ``model.state_dict()`` names (collective: call on every rank)."""
        return self._program.full_state_dict()

    # ---- inspecting ------------------------------------------------------------------------------
    @property
    def program(self) -> torch.fx.GraphModule:
        """This rank's fx program: ``print(cm.program.code)`` shows local ops and collectives."""
        return self._program.program

    def collective_counts(self) -> dict:
        """Collective calls in this rank's program by kind (gradient syncs included)."""
        return self._program.collective_counts()


# ---- pipeline parallelism ----------------------------------------------------------------------

class PipelinedModel:
    """What ``autoshard.compile(..., pp=...)`` returns on each rank: this rank's pipeline stages
    (``runtime.pipeline.PipelineProgram``) and the plan. Same training surface as ``CompiledModel``."""

    def __init__(self, plan, program, *, compile_seconds: float = 0.0):
        self.plan, self._program, self.compile_seconds = plan, program, compile_seconds

    def step(self, *inputs, target=None) -> float:
        """Forward and backward of the GLOBAL batch through the pipeline; the mean loss on every rank."""
        return self._program.step(*inputs, target=target)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self._program.parameters())

    def named_parameters(self):
        return iter(self._program.named_parameters())

    def full_state_dict(self) -> dict:
        return self._program.full_state_dict()

    @property
    def timeline(self) -> list:
        """The last step's measured compute actions on this rank (see ``write_chrome_trace``)."""
        return self._program.timeline


def _block_starts(captured, n_stages: int) -> list[str]:
    """Module prefixes cutting the longest run of numbered blocks (``blocks.0``, ``blocks.1``, ...) evenly."""
    import re
    from autoshard.passes.errors import PlanFormatError
    runs: dict[str, set] = {}
    for node in captured.gm.graph.nodes:
        path = node.meta.get("autoshard.module", "") or ""
        parts = path.split(".")
        for k in range(1, len(parts)):
            if re.fullmatch(r"\d+", parts[k]):
                runs.setdefault(".".join(parts[:k]), set()).add(int(parts[k]))
    if not runs:
        raise PlanFormatError("no repeated numbered blocks to cut into pipeline stages; pass stages= (module-name "
                              "prefixes or node names where stages 1.. start)")
    parent, idx = max(runs.items(), key=lambda kv: len(kv[1]))
    blocks = sorted(idx)
    if len(blocks) < n_stages:
        raise PlanFormatError(f"{len(blocks)} blocks under {parent!r} cannot fill {n_stages} stages; lower pp or "
                              "pass stages=")
    return [f"{parent}.{blocks[(k * len(blocks)) // n_stages]}" for k in range(1, n_stages)]


def _stage_pins(pins: dict, stage_captured) -> dict:
    """The user's parameter pins that concern this stage (patterns matching one of its parameters)."""
    import fnmatch
    names = set(stage_captured.params.values()) | set(stage_captured.aliases)
    params = {k: v for k, v in (pins.get("params") or {}).items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    return {"params": params} if params else {}


def compile_pipeline(model, mesh, env, *, example_inputs, loss_fn, example_target, pp: int, schedule, microbatches,
                     stages, state_dict, hardware, memory_limit, optimizer, time_limit_s, pins: dict) -> PipelinedModel:
    """Plan and build a pipeline on every rank. Rank 0 cuts the longest run of numbered blocks evenly (or
    at ``stages``: module-name prefixes or node names) and plans each stage's sub-graph on its submesh
    with the core planner (parameter pins that match the stage apply); the plan travels as JSON. Stage
    programs are traced at microbatch size (global batch / microbatches). The automatic stage planner
    (``passes.pipeline.planner.plan_pipeline``) is not used yet: it plans at global-batch shapes."""
    import time
    from autoshard.passes.capture import capture
    from autoshard.passes.errors import BatchError, PlanFormatError
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.pins import Pins
    from autoshard.passes.pipeline.generators import generate
    from autoshard.passes.pipeline.stage_plan import PipelinePlan
    from autoshard.passes.planner import plan_sharding
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.pipeline.executor import PipelineProgram
    from autoshard.runtime.pipeline.split import make_pipeline_plan, stage_nodes_from_prefixes, \
        stage_nodes_from_starts

    t0 = time.perf_counter()
    if isinstance(example_inputs, dict) or not isinstance(example_inputs, (tuple, list)):
        raise BatchError("pipeline parallelism takes example_inputs as a tuple of tensors (cut along dim 0)")
    if mesh.shape[0] % pp:
        raise PlanFormatError(f"pp={pp} must divide the mesh's first axis {mesh.shape[0]}")
    schedule = schedule or "1f1b"
    batch = int(example_inputs[0].shape[0])
    m = microbatches or pp
    if batch % m:
        raise BatchError(f"microbatches={m} does not divide the global batch {batch}; use a divisor of {batch}")
    virtual = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    small = tuple(x[:batch // m] for x in example_inputs)
    captured = capture(model, small, loss_fn=loss_fn, target=None if example_target is None else
                       example_target[:batch // m])
    first = mesh.shape[0] // pp
    sub_shape = ((first,) if first > 1 or mesh.ndim == 1 else ()) + tuple(mesh.shape[1:])
    phys = Mesh((pp,) + sub_shape)
    payload = None
    if env.rank == 0:
        n_stages = pp * virtual
        if stages is None:
            nodes = stage_nodes_from_prefixes(captured, _block_starts(captured, n_stages))
        elif all(isinstance(s, str) and any(n.name == s for n in captured.gm.graph.nodes) for s in stages):
            nodes = stage_nodes_from_starts(captured, stages)
        else:
            nodes = stage_nodes_from_prefixes(captured, [str(s) for s in stages])

        def solve(g, submesh):
            p = _stage_pins(pins, g.captured)
            return plan_sharding(g.captured, submesh, hardware=hardware, memory_limit=memory_limit,
                                 optimizer=optimizer, time_limit_s=time_limit_s, pins=Pins(**p) if p else None)

        plan = make_pipeline_plan(captured, nodes, phys, schedule=schedule, microbatches=m, virtual=virtual,
                                  solve=solve)
        payload = plan.to_json()
    plan = PipelinePlan.from_json(broadcast_json(payload, src=0, env=env))
    program = PipelineProgram(captured, plan, generate(schedule, pp, m, virtual), model=model, state_dict=state_dict)
    return PipelinedModel(plan, program, compile_seconds=time.perf_counter() - t0)
