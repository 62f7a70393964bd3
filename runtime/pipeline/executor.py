"""``PipelineProgram``: this rank's pipeline stages, the schedule, and the training step.

    pp = PipelineProgram(captured_mb, plan, schedule, model=model)   # on every rank, world = plan's ranks
    opt = torch.optim.AdamW(pp.parameters(), lr=1e-3)
    loss = pp.step(x, target=y); opt.step(); opt.zero_grad()          # the FULL global batch on every rank
    full = pp.full_state_dict()                                       # original names, full tensors

``captured`` is the program traced at MICROBATCH size (global batch / ``plan.microbatches``): stage
programs bake in local sizes. ``step`` cuts every input and the target into ``plan.microbatches``
along dim 0, runs this rank group's action list (``interpreter``), then: sums each replicated
parameter's gradient over its axes inside the group (``StageGradSync``: bucketed async all-reduces
launched from gradient hooks during the stage's last weight-gradient action, so they overlap it and
the rest of the step); sums the gradients of parameters held by several stages (tied embeddings:
stage 0 and the last stage each keep a copy, Megatron's embedding group) across the holders, so the
copies stay equal under any optimizer; and all-reduces the loss over the world (the last stage's
group holds it; on gloo the other ranks post their zero share when the step begins, so nobody waits
for it at the end), returning the same float everywhere: the mean over microbatches, whose
gradients equal one device's full-batch mean loss's. Random ops draw what one device running the
microbatches in order draws (``runtime.rng_streams``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.graph import META, CapturedGraph, operands
from autoshard.passes.layout.shapes import local_shape
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan
from autoshard.passes.spec import Replicate, Strategy, TensorMeta

from ..groups import choose_device_backend
from ..layout import shard_tensor
from .boundaries import boundary_placements
from ..local_batch import DataLayout, InputCheck, arrivals_for, data_layout, local_shapes
from ..redistribute import redistribute
from ..rng_streams import MicrobatchStreams
from ..state_dict import ModelState
from .groups import TieGroups, build_pipeline_envs, group_layout
from .interpreter import Interpreter, TimelineEvent, executed_schedule
from .p2p import Wiring
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph, split_stages
from .stage import StageGradSync, StageProgram

__all__ = ["PipelineProgram", "write_chrome_trace", "stage_strategies"]


def write_chrome_trace(timelines: dict[int, list[TimelineEvent]], path) -> str:
    """Write measured timelines (rank -> events, e.g. gathered from every rank's ``timeline``) as Chrome
    trace JSON (``chrome://tracing`` / Perfetto; one row per rank) with the simulator's writer."""
    from autoshard.passes.pipeline.schedule.timeline import chrome_trace
    events = [(int(r), e.action, e.start, e.end, _microbatch(e.action)) for r, evs in sorted(timelines.items())
              for e in evs]
    return chrome_trace(events, path)


def _microbatch(label: str) -> int:
    digits = ""
    for ch in reversed(label):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits or 0)


def stage_strategies(graph: StageGraph, strategies: dict[str, Strategy]) -> dict[str, Strategy]:
    """The stage's strategies, completed for received values: a Solution planned on the whole program
    (the pipeline planner's, restricted to the stage) has none for them; each is placed as its first
    reader in the stage wants it (it arrives as ``boundaries`` says, and readers redistribute from there)."""
    out = dict(strategies)
    gm = graph.captured.gm
    for name in graph.captured.inputs:
        if name in out:
            continue
        node = graph.captured.node(name)
        want = None
        for user in node.users:
            st = strategies.get(user.name)
            if st is None:
                continue
            for i, op in enumerate(operands(user)):
                if op.node is node:
                    want = tuple(st.inputs[i])
                    break
            if want is not None:
                break
        if want is None:
            raise PlanFormatError(f"stage {graph.index}: no strategy for received value {name!r} and no planned "
                                  f"reader to take one from; plan the stage's sub-graph ({gm.__class__.__name__})")
        out[name] = Strategy((), (want,))
    return out


class PipelineProgram:
    """This rank's stages of ``plan`` and the step. ``schedule``: ``dict[group, list[Action]]``; its compute
    order, as executed (``interpreter.executed_schedule``), is proven deadlock-free with
    ``simulate.check_deadlock`` first. Initial values: ``state_dict``, else ``model``'s tensors."""

    def __init__(self, captured: CapturedGraph, plan: PipelinePlan, schedule: dict, *,
                 model: Optional[nn.Module] = None, state_dict: Optional[dict] = None, seed: int = 0,
                 device=None):
        from autoshard.passes.pipeline.schedule.simulate import check_deadlock
        if not dist.is_initialized():
            raise PlanFormatError("a PipelineProgram needs torch.distributed initialized (torchrun, or "
                                  "init_process_group) with as many ranks as the plan's groups hold")
        missing = [s.index for s in plan.stages if s.solution is None]
        if missing:
            raise PlanFormatError(f"stages {missing} have no intra-stage Solution; plan each stage's sub-graph "
                                  "(plan_sharding on split_stages(...)[s].captured) before running")
        check_deadlock(executed_schedule(schedule), require_comms=False)
        mbs = sorted({a.microbatch for acts in schedule.values() for a in acts})
        if mbs != list(range(plan.microbatches)):
            raise PlanFormatError(f"the schedule runs microbatches {mbs[:3]}..{mbs[-1:]} but the plan cuts the batch "
                                  f"into {plan.microbatches}; generate the schedule with m={plan.microbatches}")
        self.plan, self.captured, self.schedule = plan, captured, schedule
        self.rank = dist.get_rank()
        dev, backend = choose_device_backend()
        self.device = torch.device(device) if device is not None else (dev if "nccl" in str(dist.get_backend()) else
                                                                       torch.device("cpu"))
        self.group, self.env = build_pipeline_envs(plan, self.rank, self.device, str(dist.get_backend()))
        self.layout = group_layout(plan)
        self.graphs = split_stages(captured, [s.nodes for s in plan.stages])
        for sched_rank, acts in schedule.items():
            for a in acts:
                if a.kind in ("F", "B", "W", "BW") and plan.stages[a.stage].group != sched_rank:
                    raise PlanFormatError(f"schedule runs {a} on rank group {sched_rank} but the plan puts stage "
                                          f"{a.stage} on group {plan.stages[a.stage].group}")
        trainable = ({n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
                     if model is not None else {})
        self._strategies = {g.index: stage_strategies(g, plan.stages[g.index].solution.strategies)
                            for g in self.graphs}
        self.boundaries = boundary_placements(plan, self.graphs, self._strategies)
        self.stages = {s.index: StageProgram(self.graphs[s.index], self._strategies[s.index], self.env, model=model,
                                             state_dict=state_dict, seed=seed, microbatches=plan.microbatches,
                                             trainable=trainable, recompute=s.recompute,
                                             arrivals={n: self.boundaries[n] for n, _ in self.graphs[s.index].receives},
                                             departures={n: self.boundaries[n] for n, _ in self.graphs[s.index].sends})
                       for s in plan.stages if s.group == self.group}
        self.wiring = self._wiring()
        gloo = "gloo" in str(dist.get_backend())
        # gloo: receives posted one action ahead overlap transfers with compute, and the loss reduction
        # is posted at once (it completes in the background). NCCL: neither (see interpreter, p2p).
        self._early_loss = gloo
        self.interpreter = Interpreter(self.stages, self.wiring, self.group, self.env.rank, self.rank, self.device,
                                       schedule, prefetch=1 if gloo else 0)
        self._grad_sync = {s: StageGradSync(st.sync_list()) for s, st in self.stages.items()}
        # random ops draw what one device running the microbatches in order draws (rng_streams)
        self._streams = MicrobatchStreams([g.captured for g in self.graphs], list(self.stages), plan.microbatches,
                                          self.device)
        self._holders = self._shared_params()
        self._ties = TieGroups(self.layout, sorted({k for _, k in self._holders.values()}), self.rank)
        self.model = model  # its state_dict hooks name the checkpoint's tensors (``state_dict.ModelState``)
        self._model_state: Optional[ModelState] = None
        self._data_layout: Optional[DataLayout] = None
        self._input_check: Optional[InputCheck] = None

    # ---- construction helpers ------------------------------------------------------------------
    def _wiring(self) -> Wiring:
        values, index = [], {}
        sends, receives = {}, {}
        for g in self.graphs:
            sends[g.index] = []
            for name, consumers in g.sends:
                index[name] = len(values)
                values.append((name, g.index))
                sends[g.index].append((index[name], consumers))
        for g in self.graphs:
            receives[g.index] = [index[name] for name, _ in g.receives]
        meta = []
        for name, producer in values:
            m = self.captured.node(name).meta[META]
            shape = local_shape(m.shape, self.boundaries[name], self.plan.stages[producer].mesh.shape,
                                what=f"pipeline boundary value {name!r}")
            meta.append((shape, m.dtype))
        return Wiring([s.group for s in self.plan.stages], {g: r for g, (_, r) in self.layout.items()},
                      values, sends, receives, meta, self.plan.microbatches)

    def _shared_params(self) -> dict[str, tuple[list[int], tuple[int, ...]]]:
        """param placeholder -> (stages holding it, the distinct groups holding it), for params in 2+ stages."""
        out = {}
        for ph in self.captured.params:
            holders = [g.index for g in self.graphs if ph in g.captured.params]
            if len(holders) > 1:
                out[ph] = (holders, tuple(sorted({self.plan.stages[s].group for s in holders})))
        return out

    # ---- running -------------------------------------------------------------------------------
    def data_layout(self) -> DataLayout:
        """The data-parallel axes of the pipeline and this rank's place along them: the axes of the rank
        groups' submesh on which every stage reading a batch input shards it on dim 0
        (``local_batch.data_layout``). Rank groups with different submeshes have none."""
        if self._data_layout is None:
            readers = [(g.captured, self._strategies[g.index],
                        g.captured.inputs[:len(g.user_inputs)] + ([g.captured.target] if g.reads_target else []))
                       for g in self.graphs if g.user_inputs or g.reads_target]
            if len({tuple(self.layout[g][0].shape) for g in self.layout}) > 1:
                readers = []
            self._data_layout = data_layout(readers, self.env.mesh, self.env.coordinate,
                                            microbatches=self.plan.microbatches)
        return self._data_layout

    def _use_local_inputs(self, local_batch: bool) -> None:
        if local_batch and self._input_check is None:
            self._input_check = InputCheck(self.data_layout(), self.env)
        for st in self.stages.values():
            st.local_inputs(local_batch, arrivals_for(self.data_layout(), self.env.mesh.ndim))

    def _microbatches(self, inputs: tuple, target, local_batch: bool = False) -> tuple[list[list], list]:
        user_names = self.captured.inputs
        if len(inputs) != len(user_names):
            raise BatchError(f"the program was traced with {len(user_names)} input(s) {user_names} but got "
                             f"{len(inputs)}")
        if target is None and self.captured.target is not None:
            raise BatchError("the program was traced with a loss: pass target= (the full global target)")
        m = self.plan.microbatches
        out = []
        for name, x in zip(list(user_names) + [self.captured.target], list(inputs) + [target]):
            meta = self.captured.node(name).meta.get(META)
            if isinstance(meta, TensorMeta):
                want = (meta.shape[0] * m,) + tuple(meta.shape[1:])
                if local_batch:
                    want = local_shapes(self.captured, self.data_layout(), m)[name]
                    if tuple(x.shape) != want:
                        raise BatchError(f"input {name!r} has shape {tuple(x.shape)}; with local_batch=True this rank "
                                         f"passes its slice of the global batch: shape {want} (data_parallel_rank "
                                         f"{self.data_layout().rank} of {self.data_layout().size})")
                if tuple(x.shape) != want:
                    raise BatchError(f"input {name!r} has shape {tuple(x.shape)}; the pipeline was traced at "
                                     f"microbatch shape {meta.shape} x {m} microbatches, so it takes the global "
                                     f"batch {want} on every rank")
                out.append(list(x.to(self.device).chunk(m, 0)))
            else:
                out.append([x] * m)
        return out[:-1], out[-1]

    def step(self, *inputs, target=None, local_batch: bool = False) -> float:
        """Forward + backward of the global batch through the pipeline; the mean loss, same on every rank.
        ``local_batch``: each rank passes only its data-parallel slice (``local_batch.py``); microbatch k
        then holds every slice's k-th 1/microbatches, the same rows as the full batch with each slice cut
        the same way (the mean loss and gradients equal the full-batch step's up to summation order)."""
        self._use_local_inputs(local_batch)
        if local_batch:
            names = list(self.captured.inputs) + [self.captured.target]
            self._input_check([(n, x) for n, x in zip(names, list(inputs) + [target]) if isinstance(x, torch.Tensor)])
        user, target_mbs = self._microbatches(inputs, target, local_batch)
        stashed = {}
        for st in self.stages.values():
            for p in st.params:
                if p.grad is not None:
                    stashed[p], p.grad = p.grad, None
        holds_loss = self.group == self.plan.stages[-1].group
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        loss_work = None
        if self._early_loss and not holds_loss:
            loss_work = dist.all_reduce(total, async_op=True)
        self._streams.begin()
        losses = self.interpreter.run(user, target_mbs, before_weights=lambda s: self._grad_sync[s].arm(),
                                      after_weights=lambda s: self._grad_sync[s].launch_rest(),
                                      weight_ready=lambda s, p: self._grad_sync[s].mark_ready(p),
                                      before_forward=self._streams.enter)
        self._streams.end()
        if holds_loss:
            for loss in losses:
                total += loss.double()
            loss_work = dist.all_reduce(total, async_op=self._early_loss)
        for sync in self._grad_sync.values():
            sync.finish()
        self._sync_tied()
        for p, g in stashed.items():
            p.grad = g if p.grad is None else p.grad + g
        if loss_work is not None:
            loss_work.wait()
        return total.item() / self.plan.microbatches

    def _sync_tied(self) -> None:
        for ph, (holders, groups) in self._holders.items():
            mine = [self.stages[s] for s in holders if s in self.stages]
            if not mine:
                continue
            meta = self.captured.node(ph).meta[META]
            total = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
            for st in mine:
                p = st.params[st.param_names.index(ph)]
                if p.grad is not None:
                    total += redistribute(p.grad, st.grad_layout(ph), (Replicate(),) * self.env.mesh.ndim, self.env)
            if len(groups) > 1:
                dist.all_reduce(total, group=self._ties.get(groups))
            for st in mine:
                p = st.params[st.param_names.index(ph)]
                if p.requires_grad:
                    p.grad = shard_tensor(total, st.grad_layout(ph), self.env.mesh.shape, self.env.coordinate).clone()

    # ---- state ---------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """Every local parameter (a weight shared by two local stages appears once per copy)."""
        return [p for s in sorted(self.stages) for p in self.stages[s].params]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(self.captured.params[ph], p) for s in sorted(self.stages)
                for ph, p in zip(self.stages[s].param_names, self.stages[s].params)]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's stages' buffers under the model's names (``runtime.local_module`` reads them)."""
        return [(self.captured.buffers.get(b, b), t) for s in sorted(self.stages)
                for b, t in zip(self.stages[s].buffer_names, self.stages[s].buffers)]

    @property
    def timeline(self) -> list[TimelineEvent]:
        """The last step's executed compute actions on this rank, in order, with measured times."""
        return list(self.interpreter.timeline)

    def model_state(self) -> ModelState:
        """The model's state over this rank's stages under ``model.state_dict()``'s names (built once; a
        collective the first time)."""
        if self._model_state is None:
            self._model_state = ModelState(self, self.model, ties=self._ties)
        return self._model_state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the original names (the model's state-dict hooks included), on every
        rank (a collective: call on every rank). Each tensor comes from the first stage holding it."""
        return self.model_state().full_state_dict()
