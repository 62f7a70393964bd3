"""``CompiledModel``: what ``autoshard.compile`` returns on each rank.

It owns this rank's program (a printable fx GraphModule of local ops and explicit collectives) and
its local parameter shards. ``step`` runs forward and backward over the global batch and leaves the
synchronized local gradients on ``parameters()``, which any ``torch.optim`` optimizer takes.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from autoshard.plans import Plan


class _TrainingState:
    """The state surface both compiled kinds share, read from the rank's program (``self._program``)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's local parameter shards (pass them to a torch.optim optimizer)."""
        return iter(self._program.parameters())

    def named_parameters(self):
        return iter(self._program.named_parameters())

    def full_state_dict(self) -> dict:
        """Full tensors under the original ``model.state_dict()`` names (collective: call on every rank)."""
        return self._program.full_state_dict()


class CompiledModel(_TrainingState):
    def __init__(self, model: torch.nn.Module, plan: Plan, env, *, state_dict: Optional[dict] = None,
                 compile_seconds: float = 0.0, planner_plan=None):
        from autoshard.runtime.executor import RankProgram

        self.plan = plan
        self.env = env
        self.compile_seconds = compile_seconds
        #: with ``pp="auto"``: the stage planner's ``PipelinePlan`` (here pp == 1: it chose no pipeline)
        self.planner_plan = planner_plan
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

    # ---- inspecting ------------------------------------------------------------------------------
    @property
    def program(self) -> torch.fx.GraphModule:
        """This rank's fx program: ``print(cm.program.code)`` shows local ops and collectives."""
        return self._program.program

    def collective_counts(self) -> dict:
        """Collective calls in this rank's program by kind (gradient syncs included)."""
        return self._program.collective_counts()


# ---- pipeline parallelism ----------------------------------------------------------------------

class PipelinedModel(_TrainingState):
    """What ``autoshard.compile(..., pp=...)`` returns on each rank when the plan pipelines: this rank's
    stages (``runtime.pipeline.PipelineProgram``), the runtime ``plan`` (stages traced and sharded at
    microbatch shapes) and ``planner_plan``, the stage planner's choice it was built from (made at
    global-batch shapes). Same training surface as ``CompiledModel``."""

    def __init__(self, plan, program, *, compile_seconds: float = 0.0, planner_plan=None):
        self.plan, self._program, self.compile_seconds = plan, program, compile_seconds
        self.planner_plan = planner_plan

    def step(self, *inputs, target=None) -> float:
        """Forward and backward of the GLOBAL batch through the pipeline; the mean loss on every rank."""
        return self._program.step(*inputs, target=target)

    @property
    def timeline(self) -> list:
        """The last step's measured compute actions on this rank (see ``write_chrome_trace``)."""
        return self._program.timeline

    def gather_timelines(self) -> dict:
        """Every rank's measured timeline of the last step, on every rank (a collective: call it on all
        ranks). ``runtime.pipeline.timelines.draw_measured_timeline`` draws it; ``write_chrome_trace``
        writes it for chrome://tracing / Perfetto."""
        from autoshard.runtime.pipeline.timelines import gather_timelines
        return gather_timelines(self._program.timeline)

    def to_dot(self) -> str:
        """The partition as graphviz dot text: one cluster per stage with its ranks and submesh."""
        from autoshard.drawing import pipeline_to_dot
        return pipeline_to_dot(self.plan, self._program.captured)

    def render(self, path: str) -> str:
        """Draw the partition to ``path`` (.svg or .png); without graphviz's ``dot``, writes .dot and
        raises RuntimeError saying how to render it (as ``Plan.render``)."""
        from autoshard.drawing import render_dot
        return render_dot(self.to_dot(), path)


def _stage_pins(pins: dict, stage_captured) -> dict:
    """The user's parameter pins that concern this stage (patterns matching one of its parameters)."""
    import fnmatch
    names = set(stage_captured.params.values()) | set(stage_captured.aliases)
    params = {k: v for k, v in (pins.get("params") or {}).items() if any(fnmatch.fnmatchcase(n, k) for n in names)}
    return {"params": params} if params else {}


def _planner_stages(captured, stages) -> Optional[list]:
    """``stages=`` for the stage planner: unit indices and node names pass; module-name prefixes become
    the name of the first op they make."""
    from autoshard.runtime.pipeline.split import stage_nodes_from_prefixes
    if stages is None:
        return None
    names = {n.name for n in captured.gm.graph.nodes if n.op == "call_function"}
    out = []
    for s in stages:
        if isinstance(s, int) or s in names:
            out.append(s)
        else:
            cut = stage_nodes_from_prefixes(captured, [str(s)])
            if len(cut) < 2:
                from autoshard.passes.errors import PlanFormatError
                raise PlanFormatError(f"stage boundary {s!r} starts at the program's first op: stage 0 needs ops "
                                      "of its own; name where stages 1.. start")
            out.append(cut[1][0])
    return out


def _on_rank0(env, work):
    """Run ``work()`` on rank 0 and broadcast its JSON result; an error there is raised on every rank
    (AutoshardErrors with their own class), so no rank waits for a plan that will never come."""
    from autoshard.passes import errors
    from autoshard.runtime.groups import broadcast_json
    payload, failure = None, None
    if env.rank == 0:
        try:
            payload = {"ok": work()}
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            failure = e
            payload = {"error": type(e).__name__, "message": str(e)}
    payload = broadcast_json(payload, src=0, env=env)
    if failure is not None:
        raise failure
    if "error" in payload:
        cls = getattr(errors, payload["error"], None)
        if not (isinstance(cls, type) and issubclass(cls, errors.AutoshardError)):
            cls, payload["message"] = RuntimeError, f"rank 0 failed to plan: {payload['error']}: {payload['message']}"
        raise cls(payload["message"])
    return payload["ok"]


def compile_pipeline(model, mesh, env, *, example_inputs, loss_fn, example_target, pp, schedule, microbatches,
                     stages, state_dict, hardware, memory_limit, optimizer, time_limit_s, pins: dict):
    """Plan and build a pipeline on every rank with the automatic stage planner.

    Rank 0 traces the program at the global batch and runs ``passes.pipeline.stages.planner.plan_pipeline``,
    which chooses pp (unless ``pp`` is an int), the stage cut, each rank group's (dp, tp) submesh, the
    microbatch count and the schedule, honouring whichever of ``pp``/``schedule``/``microbatches``/
    ``stages`` is pinned. If it chooses pp = 1, the result is an ordinary ``CompiledModel`` with its plan
    (re-solved with the user's pins if any). Otherwise every rank traces the program at microbatch
    shapes, rank 0 re-solves each stage's intra-op plan there on the planner's submesh
    (``split.replan_at_microbatch``; parameter pins matching the stage apply), and the runtime plan
    travels as JSON. Stages the planner recomputes run their forward without autograd and again before
    their backward (``runtime.pipeline.stage``). Returns a ``PipelinedModel`` or a ``CompiledModel``."""
    import time
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import BatchError
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.stages.planner import plan_pipeline
    from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.plans import graph_fingerprint
    from autoshard.runtime.pipeline.executor import PipelineProgram
    from autoshard.runtime.pipeline.split import replan_at_microbatch

    t0 = time.perf_counter()
    if isinstance(example_inputs, dict) or not isinstance(example_inputs, (tuple, list)):
        raise BatchError("pipeline parallelism takes example_inputs as a tuple of tensors (cut along dim 0)")
    from autoshard.api import hardware_label
    full = None

    def trace_full():
        nonlocal full
        if full is None:
            full = capture(model, example_inputs, loss_fn=loss_fn, target=example_target)
        return full

    def choose() -> dict:
        captured = trace_full()
        chosen = plan_pipeline(captured, mesh, hardware=hardware, memory_limit=memory_limit, optimizer=optimizer,
                               pp=None if pp == "auto" else pp, schedule=schedule, microbatches=microbatches,
                               stages=_planner_stages(captured, stages), time_limit_s=time_limit_s)
        out = {"planner": chosen.to_json()}
        if chosen.pp == 1:
            solution = chosen.stages[0].solution
            if pins.get("params"):
                solution = plan_sharding(captured, mesh, hardware=hardware, memory_limit=memory_limit,
                                         optimizer=optimizer, time_limit_s=time_limit_s,
                                         pins=Pins(params=pins["params"]))
            out["plan"] = Plan(solution, mesh, hardware_label(hardware), graph_fingerprint(captured),
                               captured).to_json()
        return out

    chosen = _on_rank0(env, choose)
    planner_plan = PipelinePlan.from_json(chosen["planner"])
    if planner_plan.pp == 1:
        plan = Plan.from_json(chosen["plan"]).attach(trace_full(), mesh)
        return CompiledModel(model, plan, env, state_dict=state_dict, compile_seconds=time.perf_counter() - t0,
                             planner_plan=planner_plan)
    m = planner_plan.microbatches
    batch = int(example_inputs[0].shape[0])
    small = capture(model, tuple(x[:batch // m] for x in example_inputs), loss_fn=loss_fn,
                    target=None if example_target is None else example_target[:batch // m])

    def solve(graph, submesh):
        p = _stage_pins(pins, graph.captured)
        return plan_sharding(graph.captured, submesh, hardware=hardware, memory_limit=memory_limit,
                             optimizer=optimizer, time_limit_s=time_limit_s, pins=Pins(**p) if p else None)

    plan = PipelinePlan.from_json(_on_rank0(env, lambda: replan_at_microbatch(planner_plan, trace_full(), small,
                                                                              solve=solve).to_json()))
    program = PipelineProgram(small, plan, generate(plan.schedule, plan.pp, m, plan.virtual), model=model,
                              state_dict=state_dict)
    return PipelinedModel(plan, program, compile_seconds=time.perf_counter() - t0, planner_plan=planner_plan)
