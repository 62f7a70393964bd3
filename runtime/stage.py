"""One stage of a plan on one rank: its lowered program with every memory lever, its local shards,
and per-microbatch F / B / W.

A plan without a pipeline has one stage, the whole program on the whole mesh; a pipeline's stages
are sub-programs on their rank groups' submeshes (``passes.pipeline.stages.stage_graphs``). Either
way the stage is lowered the same way (``lower``): its strategies, its levers
(``passes.levers.Levers``: checkpointed block instances outlined as ``regions.CheckpointRegion``,
parameter groups resharded after forward and prefetched by the program's
``param_gather.ParamGatherer``, parameter copies cast for mixed precision), MoE and ring-attention
lowerings, and the values it receives and sends placed as ``arrivals`` / ``departures``. A variant
taking only this rank's slice of the batch (``local_batch``) is lowered on first use.

``forward(mb, user, received, target)`` runs the program on one microbatch (received values arrive
as leaves that require grad) and keeps what backward needs; the forward runs under the gatherer's
saved-tensor hooks (reshard after forward). ``backward_input(mb, grads)`` (B) returns the gradients
of the received values, keeping the graph for W; ``backward_weight(mb)`` (W) then accumulates the
weight gradients into ``.grad``, restarting autograd where B stopped (``split_backward``: nothing
runs twice); ``backward(mb, grads)`` (BW) does both in one pass. On the last stage the output is the
loss as ``P`` and its seed is ``seed_scale`` (1 / the microbatches of the step), so gradients summed
over the microbatches equal the full-batch mean loss's.

With ``recompute`` (the stage planner's per-stage choice), F runs without autograd and keeps only
its inputs; the first B or BW of that microbatch runs the forward again with autograd through
``recompute.Replay``, the same helper the checkpoint regions use (same random numbers; buffers such
as BatchNorm's running statistics read as the first run read them and updated once), so a stage
holds one microbatch's activations at a time. The stage recompute does not use
``recompute.checkpointed`` (``torch.utils.checkpoint``) itself: that recomputes once per backward
graph task, and a zero-bubble B then W are two, so the forward (and its collectives) would run three
times instead of two. Block checkpoint regions inside the program do use it: under a split backward
their blocks are recomputed for B and again for W (correct; the price of combining the two).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
import math
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.passes.graph import META
from autoshard.passes.layout.shapes import local_shape, normalize
from autoshard.passes.levers import Levers
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from autoshard.passes.spec import Replicate, Strategy

from .compiled_regions import compile_regions
from .functional_collectives import functionalize
from .groups import MeshEnv
from .lower import lower
from .materialize import materialize
from .pipeline.split_backward import SplitBackward
from .recompute import Replay
from .regions import outline_regions

__all__ = ["LoweredStage"]


@dataclass(eq=False)
class _Saved:
    outputs: list
    leaves: list
    split: Optional[SplitBackward] = None
    replay: Optional[tuple] = None  # (Replay, its arguments) while the forward awaits its recompute


class LoweredStage:
    """Stage ``graph.index`` on this rank (see the module docstring). ``strategies``: the stage
    Solution's strategies; ``levers``: its memory levers (default: none pulled); ``arrivals`` /
    ``departures``: the placements its received and sent values travel at (received placeholder / sent
    node name -> placements, ``pipeline.boundaries``; absent: full). Initial values come from
    ``state_dict`` (full tensors, original names), else ``model``'s real tensors, else, for a
    meta-device model, initialization replayed with ``seed`` (``materialize``); ``trainable``: FQN ->
    requires_grad."""

    def __init__(self, graph: StageGraph, strategies: dict[str, Strategy], env: MeshEnv, *,
                 levers: Optional[Levers] = None, model: Optional[nn.Module] = None,
                 state_dict: Optional[dict] = None, seed: int = 0, seed_scale: float = 1.0,
                 trainable: Optional[dict] = None, recompute: bool = False,
                 arrivals: Optional[dict] = None, departures: Optional[dict] = None, compiler=None,
                 bucket_bytes: int = 25 * 2**20):
        self.graph, self.strategies, self.env = graph, strategies, env
        #: a ``compile_backend.RegionCompiler``: the program's collectives functional, its traceable runs
        #: compiled regions (``compiled_regions``), data-parallel regions cut at ``bucket_bytes``
        self.compiler, self._bucket_bytes = compiler, bucket_bytes
        self.levers = levers if levers is not None else Levers()
        self.recompute = recompute
        self.index = graph.index
        captured = graph.captured
        self.received_at, self.sent_at = dict(arrivals or {}), dict(departures or {})
        self._programs = {False: self._build_program()}
        self.program, self.gatherer = self._programs[False]
        local = materialize(captured, strategies, env, model=model, state_dict=state_dict, seed=seed)
        trainable = trainable or {}
        self.param_names = list(captured.params)
        self.buffer_names = list(captured.buffers)
        self.params = [nn.Parameter(local[ph], requires_grad=trainable.get(captured.params[ph], True))
                       for ph in self.param_names]
        self.buffers = [local[b] for b in self.buffer_names]
        self.seed_scale = seed_scale
        #: this round's seed per microbatch (``runtime.step_weights``), set by the executor; None: ``seed_scale``
        self.seed_scales: Optional[list[float]] = None
        self.saved: dict[int, _Saved] = {}
        self.memory_probe = None  # a ``memory_probe.MemoryProbe`` while one measures the step

    # ---- the program ---------------------------------------------------------------------------
    def _build_program(self, arrivals: Optional[dict] = None) -> tuple[fx.GraphModule, object]:
        """(program, its parameter gatherer or None): lowered with the levers, checkpointed block
        instances outlined as regions; ``arrivals`` on top of the received values' (``local_batch``)."""
        captured = self.graph.captured
        flat = lower(captured, self.strategies, self.env, self.levers, arrivals={**self.received_at, **(arrivals or {})},
                     departures=self.sent_at)
        gatherer = getattr(flat, "param_gatherer", None)
        if self.compiler is not None:
            functionalize(flat)
        program = outline_regions(flat, lambda b: self.levers.policy(b).checkpoint, set(captured.buffers))
        if self.compiler is not None:
            compile_regions(program, self.compiler, self._synced_bytes(), self._bucket_bytes)
        return program, gatherer

    def _synced_bytes(self) -> dict:
        """Placeholder name -> local bytes of each parameter whose gradient is all-reduced (stored
        replicated on an axis of size > 1)."""
        captured, shape, out = self.graph.captured, self.env.mesh.shape, {}
        for ph in captured.params:
            storage = normalize(self.strategies[ph].outputs[0], shape)
            if any(isinstance(p, Replicate) and shape[a] > 1 for a, p in enumerate(storage)):
                meta = captured.node(ph).meta[META]
                out[ph] = math.prod(local_shape(meta.shape, storage, shape)) * meta.dtype.itemsize
        return out

    @property
    def compile_report(self):
        """The current program's ``compiled_regions.CompileReport`` (None when not compiled)."""
        return getattr(self.program, "compile_report", None)

    def local_inputs(self, on: bool, arrivals: Optional[dict] = None) -> None:
        """Run the program that takes this rank's slice of the batch inputs (``on``; lowered on first use
        with ``arrivals``, ``local_batch.arrivals_for``) or the one taking full inputs."""
        if on not in self._programs:
            self._programs[on] = self._build_program(arrivals)
        self.program, self.gatherer = self._programs[on]


    def grad_layout(self, ph: str) -> tuple:
        """Placements of a parameter's gradient: its storage, with ``P`` read as ``R`` (a ``P``-stored
        parameter's gradient is the full gradient on every rank)."""
        storage = normalize(self.strategies[ph].outputs[0], self.env.mesh.shape)
        return tuple(Replicate() if p.is_partial() else p for p in storage)

    def sync_order(self) -> list:
        """(param, comm over its replicated axes) for the gradient all-reduce over the stage's mesh, in
        the order gradients become ready: reverse order of first use."""
        first_use: dict[str, int] = {}
        for i, node in enumerate(self.graph.captured.gm.graph.nodes):
            for a in node.all_input_nodes:
                if a.name in self.graph.captured.params:
                    first_use.setdefault(a.name, i)
        order = sorted(range(len(self.param_names)), key=lambda k: -first_use.get(self.param_names[k], -1))
        shape = self.env.mesh.shape
        out = []
        for k in order:
            storage = normalize(self.strategies[self.param_names[k]].outputs[0], shape)
            axes = [a for a, p in enumerate(storage) if isinstance(p, Replicate) and shape[a] > 1]
            if axes:
                out.append((self.params[k], self.env.comm_for(axes)))
        return out

    def _run(self, full: list):
        """The program on ``full`` (parameters, buffers, arguments) under the reshard hooks (and the
        memory probe, if any)."""
        probe = (self.memory_probe.forward(full) if self.memory_probe is not None else contextlib.nullcontext())
        hooks = self.gatherer.saved_tensors_hooks() if self.gatherer is not None else contextlib.nullcontext()
        with probe, hooks:
            return self.program(*full)

    def end_step(self) -> None:
        """After the step's last backward: drop what the parameter gatherer still holds."""
        if self.gatherer is not None:
            self.gatherer.end()

    # ---- per microbatch ------------------------------------------------------------------------
    def forward(self, mb: int, user: list, received: list, target=None) -> list:
        """Run on microbatch ``mb``: ``user`` inputs the stage reads, ``received`` values (this rank's
        pieces, as ``arrivals`` places them), the target on the last stage. Returns the outputs (this
        rank's pieces, as ``departures`` places them; on the last stage the local loss piece)."""
        if self.gatherer is not None and not self.saved:  # nothing in flight: a fresh forward
            self.gatherer.begin()
        leaves = []
        for t in received:
            if t.is_floating_point():
                t = t.detach().requires_grad_(True)
            leaves.append(t)
        args = list(user) + leaves + ([target] if self.graph.reads_target else [])
        full = [*self.params, *self.buffers, *args]
        if not self.recompute:
            self.saved[mb] = _Saved(self._outputs(self._run(full)), leaves)
            return self.saved[mb].outputs
        buffers = range(len(self.params), len(self.params) + len(self.buffers))
        replay = Replay(self.program, writable=buffers)
        with torch.no_grad():
            outs = self._outputs(replay(*full))
        self.saved[mb] = _Saved(outs, leaves, replay=(replay, full))
        return outs

    def forward_only(self, args: list):
        """The program on one microbatch's ``args`` without autograd (inference): its raw outputs."""
        with torch.no_grad():
            return self.program(*self.params, *self.buffers, *args)

    def _outputs(self, out) -> list:
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        return outs[:1] if self.graph.is_last else outs

    def _with_graph(self, mb: int) -> _Saved:
        """The microbatch's saved state, its forward first re-run with autograd if it was recomputed."""
        saved = self.saved[mb]
        if saved.replay is not None:
            replay, full = saved.replay
            saved.outputs = self._outputs(replay(*full))
            saved.replay = None
        return saved

    def _seeds(self, mb: int, outputs: list, grads: Optional[list]) -> tuple[list, list]:
        """(outputs to differentiate, their seeds): the scaled loss on the last stage (microbatch ``mb``'s
        weight in ``seed_scales`` when the executor set them for the round, else ``seed_scale``), else each
        output that requires grad with the gradient summed from its consumers."""
        if self.graph.is_last:
            scale = self.seed_scales[mb] if self.seed_scales is not None else self.seed_scale
            return [outputs[0]], [torch.full_like(outputs[0], scale)]
        outs, seeds = [], []
        for o, g in zip(outputs, grads):
            if o.requires_grad and g is not None:
                outs.append(o)
                seeds.append(g)
        return outs, seeds

    def _input_grads(self, leaves: list, got) -> list:
        return [None if not t.is_floating_point() else (g if g is not None else torch.zeros_like(t))
                for t, g in zip(leaves, got)]

    def backward_input(self, mb: int, grads: Optional[list] = None) -> list:
        """B: gradients of the received values (zeros where unused; None for non-float values). Runs only
        the backward nodes on paths to the received values (``split_backward``)."""
        saved = self._with_graph(mb)
        outs, seeds = self._seeds(mb, saved.outputs, grads)
        wanted = [t for t in saved.leaves if t.requires_grad]
        saved.split = SplitBackward(outs, seeds, wanted, [p for p in self.params if p.requires_grad])
        got = saved.split.input_grads() if outs else [None] * len(wanted)
        it = iter(got)
        return self._input_grads(saved.leaves, [next(it) if t.requires_grad else None for t in saved.leaves])

    def backward_weight(self, mb: int, on_ready: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """W: accumulate the weight gradients of microbatch ``mb`` (after its B) and free its graph;
        ``on_ready(p)`` as each parameter's gradient lands (``SplitBackward.weight_grads``)."""
        saved = self.saved.pop(mb)
        if saved.split is None:
            raise RuntimeError(f"stage {self.index}: W{mb} ran before B{mb}; the schedule must run B before W")
        saved.split.weight_grads(on_ready)

    def backward(self, mb: int, grads: Optional[list] = None) -> list:
        """BW: input and weight gradients in one pass; frees the microbatch's graph."""
        saved = self._with_graph(mb)
        del self.saved[mb]
        outs, seeds = self._seeds(mb, saved.outputs, grads)
        if outs:
            torch.autograd.backward(outs, seeds)
        return self._input_grads(saved.leaves, [t.grad if t.requires_grad else None for t in saved.leaves])

    # ---- state ---------------------------------------------------------------------------------
    def input_meta(self) -> list:
        """The stage's placeholder metas of its inputs, in order."""
        captured = self.graph.captured
        return [captured.node(n).meta.get(META) for n in captured.inputs]
