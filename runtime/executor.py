"""``RankProgram``: this rank's part of a plan (its stages, run under the plan's schedule) and the step.

One program type runs every plan (``passes.pipeline.plan.Plan``: a list of stages under a schedule)::

    rp = RankProgram(plan, model=model)                        # under torchrun, every rank
    opt = torch.optim.AdamW(rp.parameters(), lr=1e-3)          # local shards
    loss = rp.step(x, target=y); opt.step(); opt.zero_grad()   # the full global batch on every rank
    print(rp.program.code)                                     # local ops + named collectives

``plan.captured`` is the program of ONE microbatch: the global batch / (accumulation x microbatches).

- **Stages**: this rank's stages of the plan, each a ``stage.LoweredStage``: the stage's lowered
  program with every memory lever its Solution carries (checkpointed blocks, reshard after forward
  with prefetch, mixed precision), MoE and ring-attention lowerings, its local shards, and F / B / W
  per microbatch. A plan without a pipeline has one stage: the whole program on the whole mesh
  (``setup_distributed``'s groups); a pipeline's rank group runs its stages on its submesh
  (``pipeline.groups``), values crossing stages at their planned placement (``pipeline.boundaries``).
- **Schedule**: ``generate(plan.schedule, pp, microbatches, virtual)``, data (``Action`` lists per
  rank group), proven deadlock-free first, run by the interpreter (``pipeline.interpreter``) with
  point-to-point transfers derived from it; without a pipeline it is one stage's F then BW.
- **Step**: the global batch is cut into accumulation x microbatches along dim 0
  (``step_inputs``); the schedule runs once per round of accumulation, each round on its
  ``microbatches`` consecutive slices (torchtitan's gradient accumulation under a pipeline: the
  schedule run k times per step); every backward is seeded 1 / (accumulation x microbatches), so the
  gradients summed over the rounds and microbatches are the full-batch mean loss's (a mean class loss
  whose microbatches count different numbers of non-ignored targets: each seeded with its share of the
  step's count instead, ``step_weights``). Each stage's
  replicated gradients are all-reduced over its mesh (``gradsync.GradSync``, one per stage, with
  ``reduce_dtype`` under mixed precision), armed for the last round's last weight-gradient action of
  the stage only, so the reduction overlaps that action and the rest of the step. Parameters in ZeRO
forms are left out of it: each stage's ``zero.ZeroSync`` reduce-scatters them around the stage's weight
actions and the optimizer steps their slices (``stage_zeros``). Parameters held by
  several stages (tied embeddings: stage 0 and the last stage each keep a copy, Megatron's embedding
  group) have their gradients summed across the holders (``pipeline.tied_grads``), so the copies stay
  equal under any optimizer. The returned loss is the mean over the microbatches, the same float on every rank:
  without a pipeline it rides in a gradient bucket reduced over every axis (or is all-reduced
  alone); a pipeline all-reduces it over the world from the last stage's group (on gloo the other
  ranks post their zero share when the step begins, so nobody waits for it at the end).

Gradients already present when a step begins (accumulation across steps without ``zero_grad``) are
set aside and added back after the reduction, so they are not summed twice. ``memory_probe`` (a
``memory_probe.MemoryProbe`` while one is active) measures a step. Random ops of a pipeline draw what
one device running the microbatches in order draws (``rng_streams``). Every collective and transfer of
a step runs under ``collective_watch``'s timeout, armed when the program is built: a rank left waiting
raises ``CollectiveError`` naming its rank, stage, action and op.

``compile`` (a ``compile_backend.CompileOptions``): each stage's collectives become functional
(``functional_collectives``) and its traceable runs ``torch.compile``'d regions (``compiled_regions``);
``compile_report`` says what was compiled, what stayed eager and why, and what compiling cost.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autoshard.passes.errors import BatchError, MeshError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.pipeline.plan import Plan
from autoshard.passes.pipeline.schedule.generators import generate
from autoshard.passes.pipeline.stages.stage_graphs import split_stages, whole_program

from .collective_watch import arm_timeout, watching
from .compile_backend import CompileOptions, RegionCompiler
from .gradsync import GradSync
from .groups import MeshEnv, choose_device_backend, setup_distributed
from .local_batch import DataLayout, InputCheck, arrivals_for, data_layout, local_shapes
from .lower import COLLECTIVE_META, PARAM_STEPS_META
from .pipeline.boundaries import boundary_placements, stage_strategies, wiring
from .pipeline.groups import TieGroups, build_pipeline_envs, group_layout
from .pipeline.interpreter import Interpreter, TimelineEvent
from .pipeline.schedule_check import check_schedule
from .pipeline.tied_grads import shared_params, sum_tied_gradients
from .rng_streams import MicrobatchStreams
from .stage import LoweredStage
from .state_dict import ModelState
from .stage_zeros import StageZeros
from .step_inputs import StepInputs
from .step_results import LossReduction, assembled
from .step_weights import StepWeights

__all__ = ["RankProgram"]


class RankProgram:
    """This rank's stages of ``plan`` and the step (see the module docstring).

    ``env``: a plan without a pipeline runs on this ``MeshEnv`` (default: ``setup_distributed(plan.mesh)``);
    a pipeline builds its groups' (``torch.distributed`` must be initialized with the plan's ranks).
    Initial values come from ``state_dict`` (full tensors, original names), else ``model``'s real
    tensors, else, for a meta-device model, initialization replayed with ``seed``. ``schedule``: the
    action lists to run (default: the plan's, ``generate``). ``bucket_mb``/``first_bucket_mb`` size
    the gradient all-reduce buckets; ``device``: where a pipeline's local shards live (default: the
    backend's device)."""

    def __init__(self, plan: Plan, *, env: Optional[MeshEnv] = None, model: Optional[nn.Module] = None,
                 state_dict: Optional[dict] = None, seed: int = 0, schedule: Optional[dict] = None,
                 device: Any = None, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 compile: Optional[CompileOptions] = None):
        if plan.captured is None:
            raise PlanFormatError("the plan has no program: attach it to the program traced at one microbatch first "
                                  "(plan.attach(captured))")
        missing = [s.index for s in plan.stages if s.solution is None]
        if missing:
            raise PlanFormatError(f"stages {missing} have no intra-stage Solution; plan each stage's sub-graph "
                                  "(plan_sharding on split_stages(...)[s].captured) before running")
        self.plan, self.captured = plan, plan.captured
        self.rounds, self.microbatches = plan.accumulation, plan.microbatches
        self._setup_groups(env, device)
        self.schedule = schedule if schedule is not None else generate(plan.schedule, plan.pp, plan.microbatches,
                                                                      plan.virtual)
        check_schedule(plan, self.schedule)
        if plan.pipelined:
            self.graphs = split_stages(self.captured, [s.nodes for s in plan.stages])
            self._strategies = {g.index: stage_strategies(g, plan.stages[g.index].solution.strategies)
                                for g in self.graphs}
            self.boundaries = boundary_placements(plan, self.graphs, self._strategies)
        else:
            self.graphs = [whole_program(self.captured)]
            self._strategies = {0: plan.stages[0].solution.strategies}
            self.boundaries = {}
        trainable = ({n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
                     if model is not None else {})
        n = self.rounds * self.microbatches
        #: with ``compile``: each stage's program through torch.compile by regions (the schedule's sends
        #: and receives, parameter gathers and checkpoint wrappers stay outside them)
        self.compiler = RegionCompiler(compile, self.env.device) if compile is not None else None
        self.stages = {s.index: LoweredStage(self.graphs[s.index], self._strategies[s.index], self.env,
                                             levers=s.solution.levers, model=model, state_dict=state_dict, seed=seed,
                                             seed_scale=1.0 / n, trainable=trainable, recompute=s.recompute,
                                             arrivals={v: self.boundaries[v] for v, _ in self.graphs[s.index].receives},
                                             departures={v: self.boundaries[v] for v, _ in self.graphs[s.index].sends},
                                             compiler=self.compiler, bucket_bytes=int(bucket_mb * 2**20))
                       for s in plan.stages if s.group == self.group}
        gloo = "gloo" in str(self.env.backend or "gloo")
        # gloo: receives posted one action ahead overlap transfers with compute, and a pipeline's loss
        # reduction is posted at once (it completes in the background). NCCL: neither (interpreter, p2p).
        self._early_loss = gloo and plan.pp > 1
        self.wiring = wiring(plan, self.graphs, self.boundaries, self.captured)
        self.interpreter = Interpreter(self.stages, self.wiring,
                                       self.group, self.env.rank, dist.get_rank() if plan.pp > 1 else self.env.rank,
                                       self.device, self.schedule, prefetch=1 if gloo and plan.pp > 1 else 0)
        self._loss_comm = None if plan.pp > 1 else self.env.comm_for([a for a, s in enumerate(plan.mesh.shape) if s > 1])
        # parameters in ZeRO forms: the optimizer steps their slices, each stage's ``ZeroSync`` reduces
        # and gathers them over the stage's (sub)mesh (``runtime.zero``); the grad sync leaves them out
        self._holders = shared_params(plan, self.captured, self.graphs)
        self._zeros = StageZeros.of(plan, self.captured, self.stages, self._strategies, self.env, self._holders,
                                    int(bucket_mb * 2**20))
        self._syncs = {s: self._grad_sync(st, bucket_mb, first_bucket_mb) for s, st in self.stages.items()}
        self._ties = (TieGroups(self.layout, sorted({k for _, k in self._holders.values()}), dist.get_rank())
                      if plan.pp > 1 else None)
        cast = any(st.levers.mixed_precision is not None for st in self.stages.values())
        self._inputs = StepInputs(self.captured, n, self.device, cast=cast)
        self._weights = StepWeights(self.captured, self.device, n)
        # random ops draw what one device running the microbatches in order draws (rng_streams); one
        # stage runs them in that order already
        self._streams = (MicrobatchStreams([g.captured for g in self.graphs], list(self.stages), self.microbatches,
                                           self.device) if plan.pipelined else None)
        arm_timeout()  # from here a collective that waits past the timeout is an error (collective_watch)
        self.model = model  # its state_dict hooks name the checkpoint's tensors (``state_dict.ModelState``)
        self._model_state: Optional[ModelState] = None
        self._data_layout: Optional[DataLayout] = None
        self._input_check: Optional[InputCheck] = None

    # ---- construction helpers ------------------------------------------------------------------
    @classmethod
    def of_strategies(cls, captured: CapturedGraph, strategies: dict, mesh: Any, *, levers=None, **kw) -> "RankProgram":
        """The program of a plan of one stage from placements alone (``Plan.of_strategies``)."""
        return cls(Plan.of_strategies(captured, strategies, mesh, levers), **kw)

    def _setup_groups(self, env: Optional[MeshEnv], device: Any) -> None:
        plan = self.plan
        if plan.pp > 1:
            if not dist.is_initialized():
                raise PlanFormatError("a pipelined program needs torch.distributed initialized (torchrun, or "
                                      "init_process_group) with as many ranks as the plan's groups hold")
            backend = str(dist.get_backend())
            dev = choose_device_backend()[0]
            self.device = torch.device(device) if device is not None else (dev if "nccl" in backend
                                                                           else torch.device("cpu"))
            self.group, self.env = build_pipeline_envs(plan, dist.get_rank(), self.device, backend)
            self.layout = group_layout(plan)
            return
        self.env = env if env is not None else setup_distributed(plan.mesh, device=device)
        if self.env.mesh.shape != plan.mesh.shape:
            raise MeshError(f"the plan is for mesh {plan.mesh.shape} but the process groups were built for "
                            f"{self.env.mesh.shape}; call setup_distributed with the plan's mesh")
        self.device, self.group = self.env.device, 0
        self.layout = {0: (plan.mesh, list(range(plan.mesh.size)))}

    @property
    def _zero(self):
        """The ZeroSync of this rank's one stage (None without ZeRO parameters; ``zero_calls`` sums
        over several stages)."""
        return self._zeros.get(next(iter(self.stages))) if len(self.stages) == 1 else None

    def zero_calls(self) -> dict[str, int]:
        """The collectives ``runtime.zero`` called on this rank so far, by kind, over its stages."""
        return self._zeros.calls()

    def _grad_sync(self, stage: LoweredStage, bucket_mb: float, first_bucket_mb: float) -> GradSync:
        mp = stage.levers.mixed_precision
        order = stage.sync_order() if self.captured.loss_output else []
        zero = self._zeros.get(stage.index)
        if zero is not None:  # a ZeRO parameter is reduced by ``zero``
            order = [(p, comm) for p, comm in order if zero.optimizer_parameter(p) is p]
        # a forward-only program never has gradients: no buckets for them
        # a zero-bubble W sets gradients outside autograd's hooks: their buckets stay copied into
        in_buckets = not any(a.kind == "W" and a.stage == stage.index for acts in self.schedule.values() for a in acts)
        return GradSync(order, bucket_bytes=int(bucket_mb * 2**20),
                        first_bucket_bytes=int(first_bucket_mb * 2**20), carry_comm=self._loss_comm,
                        reduce_dtype=None if mp is None else (mp.reduce_dtype or mp.param_dtype),
                        grads_in_buckets=in_buckets)

    # ---- what it runs ----------------------------------------------------------------------------
    def _only(self) -> LoweredStage:
        if len(self.stages) != 1:
            raise AttributeError(f"this rank runs {len(self.stages)} stages ({sorted(self.stages)}): read "
                                 "program.stages[s].program")
        return next(iter(self.stages.values()))

    @property
    def program(self) -> fx.GraphModule:
        """This rank's fx program (of its one stage): ``print(rp.program.code)``."""
        return self._only().program

    @property
    def gatherer(self):
        """The parameter gatherer of this rank's one stage (None when it gathers no parameter)."""
        return self._only().gatherer

    @property
    def strategies(self) -> dict:
        """The strategies of this rank's one stage."""
        return self._only().strategies

    @property
    def mesh(self):
        """The (sub)mesh this rank's stages run on."""
        return self.env.mesh

    @property
    def memory_probe(self):
        return self._only().memory_probe

    @memory_probe.setter
    def memory_probe(self, probe) -> None:
        for st in self.stages.values():
            st.memory_probe = probe

    @property
    def compile_report(self):
        """With ``compile``: one ``compiled_regions.CompileReport`` over this rank's stages' current
        programs (what was compiled, what stayed eager and why, what compiling cost); None otherwise."""
        if self.compiler is None:
            return None
        from .compiled_regions import CompileReport
        reports = [st.compile_report for st in self.stages.values() if st.compile_report is not None]
        return reports[0] if len(reports) == 1 else CompileReport.combined(reports)

    @property
    def timeline(self) -> list[TimelineEvent]:
        """The last step's executed compute actions on this rank, in order, with measured times."""
        return list(self.interpreter.timeline)

    # ---- running -------------------------------------------------------------------------------
    def data_layout(self) -> DataLayout:
        """The data-parallel axes and this rank's place along them: the axes of the (sub)mesh on which
        every stage reading a batch input shards it on dim 0 (``local_batch.data_layout``); a pipeline
        whose rank groups have different submeshes has none."""
        if self._data_layout is None:
            readers = [(g.captured, self._strategies[g.index],
                        g.captured.inputs[:len(g.user_inputs)] + ([g.captured.target] if g.reads_target else []))
                       for g in self.graphs if g.user_inputs or g.reads_target]
            if len({tuple(mesh.shape) for mesh, _ in self.layout.values()}) > 1:
                readers = []
            self._data_layout = data_layout(readers, self.env.mesh, self.env.coordinate,
                                            microbatches=self.rounds * self.microbatches)
        return self._data_layout

    def _prepared(self, inputs: tuple, target, local_batch: bool) -> tuple[list, list]:
        """(per user input, its microbatches; the target's), with every stage's program taking what is
        passed: the full batch, or with ``local_batch`` this rank's slice (``local_batch.py``; lowered on
        first use), after checking the slices agree where they must."""
        if not local_batch:
            for st in self.stages.values():
                st.local_inputs(False)
            return self._inputs.cut(inputs, target)
        if self.rounds > 1:
            raise BatchError("local_batch=True with gradient accumulation is not supported yet: pass the full "
                             "global batch (local_batch=False), or compile without accumulation=")
        layout = self.data_layout()
        if self._input_check is None:
            self._input_check = InputCheck(layout, self.env)
        for st in self.stages.values():
            st.local_inputs(True, arrivals_for(layout, self.env.mesh.ndim))
        names = list(self.captured.inputs) + ([self.captured.target] if self.captured.target is not None else [])
        given = list(inputs) + ([target] if self.captured.target is not None else [])
        where = f" (rows of data_parallel_rank {layout.rank} of {layout.size})"
        user, targets = self._inputs.cut(inputs, target, local_shapes(self.captured, layout, self._inputs.n), where)
        self._input_check([(n, x) for n, x in zip(names, given) if isinstance(x, torch.Tensor)])
        return user, targets

    def step(self, *inputs, target=None, local_batch: bool = False) -> float:
        """Forward + backward over the global batch (see the module docstring); gradients land on
        ``parameters()``. Returns the mean loss (identical on every rank). With ``local_batch``, each rank
        passes only its data-parallel slice (``local_batch.py``): microbatch i then holds every slice's
        i-th part, the same rows as the full batch with each slice cut the same way (the mean loss and
        gradients equal the full-batch step's up to summation order)."""
        if not self.captured.loss_output:
            raise BatchError("step() needs a program traced with a loss function (loss_fn=...); "
                             "this one returns outputs: call forward()")
        user, targets = self._prepared(inputs, target, local_batch)
        weights = self._microbatch_weights(user, targets, local_batch)
        gatherers = [st.gatherer for st in self.stages.values() if st.gatherer is not None]
        self._zeros.begin_step()
        for g in gatherers:
            g.begin_step()
        stashed = self._set_aside()
        holds_loss = self.group == self.plan.stages[-1].group
        losses: list = []
        loss = LossReduction(self.rounds * self.microbatches, self.device, self._loss_comm, holds_loss,
                             early=self._early_loss, weights=weights)
        m = self.microbatches
        last_stage = self.plan.stages[-1].index

        def before_weights(s: int) -> None:
            if s == last_stage and self._loss_comm is not None:
                loss.start_alone(losses, self._syncs[s])
            self._syncs[s].arm()

        try:
            for r in range(self.rounds):
                final = r == self.rounds - 1
                hooks = dict(before_weights=before_weights, after_weights=lambda s: self._syncs[s].launch_rest(),
                             weight_ready=lambda s, p: self._syncs[s].mark_ready(p)) if final else {}
                for g in gatherers:
                    g.final = final  # storage form ``once``: the copies' gradients are reduced in the last round
                if self._streams is not None:
                    self._streams.begin()
                for st in self.stages.values():
                    st.seed_scales = None if weights is None else weights[r * m:(r + 1) * m]
                if self._zeros:  # ZeRO buckets reduce around every weight action (zero1's: the step's last)
                    hooks.update(around_weights=lambda s, after, last, final=final: self._zeros.around(
                                     s, after, final and last),
                                 weight_ready=lambda s, p, sync=hooks.get("weight_ready"): self._zeros.ready(s, p, sync))
                self.interpreter.run([u[r * m:(r + 1) * m] for u in user], targets[r * m:(r + 1) * m],
                                     losses=losses, before_forward=self._streams and self._streams.enter, **hooks)
                if self._streams is not None:
                    self._streams.end()
        finally:
            for st in self.stages.values():
                st.end_step()
                st.seed_scales = None
            for g in gatherers:
                g.final = True
        with watching(action=f"the gradient and loss reductions after the step of stages {sorted(self.stages)}"):
            for sync in self._syncs.values():
                sync.finish()
            sum_tied_gradients(self._holders, self.stages, self.captured, self.env, self.device, self._zeros,
                               self._ties)
            self._restore(stashed)
            return loss.result(losses)

    def _microbatch_weights(self, user: list, targets: list, local_batch: bool) -> Optional[list[float]]:
        """Each microbatch's share of the step's mean loss (``step_weights``; None: 1 / n each). With
        ``local_batch`` the counts of every data-parallel slice are summed over the world."""
        replicas = None
        if local_batch and self._weights.counts:
            replicas = (dist.get_world_size() if dist.is_initialized() else 1) // max(self.data_layout().size, 1)
        return self._weights(user, targets, replicas=replicas)

    def _set_aside(self) -> dict:
        """Take the gradients present before the step off the parameters: each grad sync takes its own
        (``GradSync.begin_step``: a copy where one lives in a bucket the step overwrites) and points
        them at their buckets."""
        stashed = {p: g for sync in self._syncs.values() for p, g in sync.begin_step().items()}
        in_bucket = set().union(*(sync.in_bucket for sync in self._syncs.values()))
        for p in self.parameters():
            if p.grad is not None and p not in in_bucket:
                stashed[p] = p.grad
                p.grad = None
        return stashed

    def _restore(self, stashed: dict) -> None:
        for p, g in stashed.items():
            p.grad = g if p.grad is None else p.grad.add_(g)

    def forward(self, *inputs, target=None, local_batch: bool = False):
        """Forward only, without autograd (a plan without a pipeline): the full outputs (the loss,
        all-reduced, for a loss program; with accumulation, the mean loss over the microbatches or the
        outputs concatenated on dim 0), in the model's own output object when capture recorded one
        (``captured.output_structure``). ``local_batch``: as in ``step``; the outputs are still the full
        batch's."""
        if self.plan.pipelined:
            raise BatchError("a pipelined program runs training steps (step(...)); forward-only inference through "
                             "pipeline stages is not supported: compile without pp= for inference")
        user, targets = self._prepared(inputs, target, local_batch)
        self.sync_parameters()
        stage = self._only()
        reads_target = self.captured.target is not None
        outs = [stage.forward_only([u[i] for u in user] + ([targets[i]] if reads_target else []))
                for i in range(self._inputs.n)]
        stage.end_step()
        weights = self._microbatch_weights(user, targets, local_batch) if self.captured.loss_output else None
        return assembled(self.captured, outs, self._loss_comm, weights)

    __call__ = forward

    # ---- state ---------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: every local parameter (a weight shared by two local stages appears
        once per copy), each ZeRO parameter's slice in its place (``zero.ZeroSync``)."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(self.captured.params[ph], self.optimizer_parameter(p)) for s in sorted(self.stages)
                for ph, p in zip(self.stages[s].param_names, self.stages[s].params)]

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters the program computes with (a ZeRO parameter whole), stage by stage."""
        return [p for s in sorted(self.stages) for p in self.stages[s].params]

    def optimizer_parameter(self, param: nn.Parameter) -> nn.Parameter:
        """What the optimizer steps in place of local parameter ``param`` (its ZeRO slice, or itself)."""
        return self._zeros.optimizer_parameter(param)

    def sync_parameters(self) -> None:
        """Gather the ZeRO parameters the optimizer changed (``zero.ZeroSync.gather``; a collective when
        any did, on every rank alike): ``step``, ``forward`` and the state dicts call it."""
        self._zeros.gather()

    def buffers(self) -> list[torch.Tensor]:
        return [b for s in sorted(self.stages) for b in self.stages[s].buffers]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's stages' buffers under the model's names (``runtime.local_module`` reads them)."""
        return [(self.captured.buffers.get(b, b), t) for s in sorted(self.stages)
                for b, t in zip(self.stages[s].buffer_names, self.stages[s].buffers)]

    def model_state(self) -> ModelState:
        """The model's state over this rank's stages under ``model.state_dict()``'s names (built once; a
        collective the first time for a pipeline; the ZeRO parameters gathered first)."""
        self.sync_parameters()
        if self._model_state is None:
            self._model_state = ModelState(self, self.model, ties=self._ties)
        return self._model_state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the original ``model.state_dict()`` names (tied aliases and the model's
        state-dict hooks included). A collective: call it on every rank."""
        return self.model_state().full_state_dict()

    # ---- inspecting ----------------------------------------------------------------------------
    def collective_counts(self) -> dict[str, int]:
        """Collective steps in this rank's forward programs by kind (a parameter gather counts its
        members' steps; a fused member, gathered over several axes flattened, one all-gather), plus
        ``grad_sync`` (parameters whose gradient is all-reduced) and ``grad_sync_buckets`` (the
        all-reduce calls doing it)."""
        counts: dict[str, int] = {}
        for st in self.stages.values():
            for module in st.program.modules():
                if not isinstance(module, fx.GraphModule):
                    continue
                for node in module.graph.nodes:
                    kinds = [node.meta[COLLECTIVE_META]] if node.meta.get(COLLECTIVE_META) else []
                    for kind in kinds + list(node.meta.get(PARAM_STEPS_META, ())):
                        counts[kind] = counts.get(kind, 0) + 1
        synced = sum(sync.num_params for sync in self._syncs.values())
        if synced:
            counts["grad_sync"] = synced
            counts["grad_sync_buckets"] = sum(len(sync.buckets) for sync in self._syncs.values())
        return counts
