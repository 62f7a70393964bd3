"""One pipeline stage on one rank: the core runtime's lowered program for the stage's sub-graph and
Solution on its group's submesh, its local parameter shards, and per-microbatch F / B / W.

``forward(mb, args)`` runs the program on one microbatch (received values arrive as leaves that
require grad) and keeps what backward needs. ``backward_input(mb, grads)`` (B) returns the gradients
of the received values, keeping the graph for W; ``backward_weight(mb)`` (W) then accumulates the
weight gradients into ``.grad``, restarting autograd where B stopped (``split_backward``: nothing
runs twice); ``backward(mb, grads)`` (BW) does both in one pass. With ``recompute``, F runs without
autograd and keeps only its inputs; the first B or BW of that microbatch runs the forward again with
autograd through ``recompute.Replay``, the same helper the plain path's checkpoint regions use (same
random numbers; buffers such as BatchNorm's running statistics read as the first run read them and
updated once), so a stage holds one microbatch's activations at a time. The stage does not use
``recompute.checkpointed`` (``torch.utils.checkpoint``) itself: that recomputes once per backward
graph task, and a zero-bubble B then W are two, so the forward (and its collectives) would run three
times instead of two. On the last
stage the output is the loss as ``P`` and its seed is ``1 / microbatches``, so gradients summed over
microbatches equal the full-batch mean loss's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.passes.graph import META
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.spec import Replicate, Strategy

from ..compiled_regions import compile_regions
from ..functional_collectives import functionalize
from ..lower import lower
from ..materialize import materialize
from ..recompute import Replay
from .groups import SubmeshEnv
from autoshard.passes.pipeline.stages.stage_graphs import StageGraph
from .split_backward import SplitBackward

__all__ = ["StageProgram", "StageGradSync"]


@dataclass(eq=False)
class _Saved:
    outputs: list
    leaves: list
    split: Optional[SplitBackward] = None
    replay: Optional[tuple] = None  # (Replay, its arguments) while the forward awaits its recompute


class StageProgram:
    """Stage ``graph.index`` on this rank. ``strategies``: the stage Solution's strategies;
    ``arrivals`` / ``departures``: the placements its received and sent values travel at (received
    placeholder / sent node name -> placements, ``boundaries.boundary_placements``; absent: full)."""

    def __init__(self, graph: StageGraph, strategies: dict[str, Strategy], env: SubmeshEnv, *,
                 model: Optional[nn.Module] = None, state_dict: Optional[dict] = None, seed: int = 0,
                 microbatches: int = 1, trainable: Optional[dict] = None, recompute: bool = False,
                 arrivals: Optional[dict] = None, departures: Optional[dict] = None, compiler=None):
        self.graph, self.strategies, self.env = graph, strategies, env
        self.compiler = compiler  # a ``compile_backend.RegionCompiler``: the program's regions compiled
        self.recompute = recompute
        self.index = graph.index
        captured = graph.captured
        self.received_at, self.sent_at = dict(arrivals or {}), dict(departures or {})
        self.program = self._lowered(self.received_at)
        self._programs = {False: self.program}
        local = materialize(captured, strategies, env, model=model, state_dict=state_dict, seed=seed)
        trainable = trainable or {}
        self.param_names = list(captured.params)
        self.buffer_names = list(captured.buffers)
        self.params = [nn.Parameter(local[ph], requires_grad=trainable.get(captured.params[ph], True))
                       for ph in self.param_names]
        self.buffers = [local[b] for b in self.buffer_names]
        self.input_meta = [captured.node(n).meta.get(META) for n in captured.inputs]
        self.n_user = len(graph.user_inputs)
        self.seed_scale = 1.0 / microbatches
        self.saved: dict[int, _Saved] = {}

    def local_inputs(self, on: bool, arrivals: Optional[dict] = None) -> None:
        """Run the program that takes this rank's slice of the batch inputs (``on``; lowered on first use
        with ``arrivals``, see ``local_batch.arrivals_for``) or the one taking full inputs."""
        if on not in self._programs:
            self._programs[on] = self._lowered({**self.received_at, **(arrivals or {})})
        self.program = self._programs[on]

    def _lowered(self, arrivals: dict):
        """The stage's program taking its inputs as ``arrivals`` places them; with a ``compiler``, its
        collectives functional and its traceable runs compiled regions (``compiled_regions``)."""
        program = lower(self.graph.captured, self.strategies, self.env, arrivals=arrivals, departures=self.sent_at)
        if self.compiler is not None:
            functionalize(program)
            compile_regions(program, self.compiler)
        return program

    def grad_layout(self, ph: str) -> tuple:
        """Placements of a parameter's gradient: its storage, with ``P`` read as ``R`` (a ``P``-stored
        parameter's gradient is the full gradient on every rank)."""
        storage = normalize(self.strategies[ph].outputs[0], self.env.mesh.shape)
        return tuple(Replicate() if p.is_partial() else p for p in storage)

    def sync_list(self) -> list:
        """(param, comm over its replicated axes) for the gradient all-reduce inside the group."""
        out = []
        for ph, p in zip(self.param_names, self.params):
            storage = normalize(self.strategies[ph].outputs[0], self.env.mesh.shape)
            axes = [a for a, pl in enumerate(storage) if isinstance(pl, Replicate) and self.env.mesh.shape[a] > 1]
            if axes and p.requires_grad:
                out.append((p, self.env.comm_for(axes)))
        return out

    # ---- per microbatch ------------------------------------------------------------------------
    def forward(self, mb: int, user: list, received: list, target=None) -> list:
        """Run on microbatch ``mb``: ``user`` inputs the stage reads, ``received`` values (this rank's
        pieces, as ``arrivals`` places them), the target on the last stage. Returns the outputs (this
        rank's pieces, as ``departures`` places them; on the last stage the local loss piece)."""
        leaves = []
        for t in received:
            if t.is_floating_point():
                t = t.detach().requires_grad_(True)
            leaves.append(t)
        args = list(user) + leaves + ([target] if self.graph.reads_target else [])
        full = [*self.params, *self.buffers, *args]
        if not self.recompute:
            self.saved[mb] = _Saved(self._outputs(self.program(*full)), leaves)
            return self.saved[mb].outputs
        buffers = range(len(self.params), len(self.params) + len(self.buffers))
        replay = Replay(self.program, writable=buffers)
        with torch.no_grad():
            outs = self._outputs(replay(*full))
        self.saved[mb] = _Saved(outs, leaves, replay=(replay, full))
        return outs

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

    def _seeds(self, outputs: list, grads: Optional[list]) -> tuple[list, list]:
        """(outputs to differentiate, their seeds): the scaled loss on the last stage, else each output
        that requires grad with the gradient summed from its consumers."""
        if self.graph.is_last:
            return [outputs[0]], [torch.full_like(outputs[0], self.seed_scale)]
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
        outs, seeds = self._seeds(saved.outputs, grads)
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
        outs, seeds = self._seeds(saved.outputs, grads)
        if outs:
            torch.autograd.backward(outs, seeds)
        return self._input_grads(saved.leaves, [t.grad if t.requires_grad else None for t in saved.leaves])


class StageGradSync:
    """All-reduce one stage's replicated gradients inside its group, overlapped with the stage's last
    weight-gradient action of the step.

    ``pairs``: (parameter, comm over its replicated axes), as ``StageProgram.sync_list`` gives. Buckets
    follow the parameters in reverse (the order backward finishes them), split by comm and dtype and
    capped at ``bucket_bytes``. ``arm()`` right before the last action that adds to the stage's weight
    gradients; each parameter's post-accumulate-grad hook then marks its gradient final, and full buckets
    launch async all-reduces strictly in order, so every rank of the group issues the same collectives in
    the same order; a zero-bubble W, which sets gradients without hooks, reports them through
    ``mark_ready``. ``launch_rest()`` after that action launches what is left (a parameter without
    gradient contributes zeros); ``finish()`` waits and
    writes the sums into ``.grad``. ``overlapped``: buckets launched from hooks in the last step."""

    def __init__(self, pairs: list, bucket_bytes: int = 4 * 2**20):
        self.buckets: list[tuple] = []
        for p, comm in reversed(pairs):
            last = self.buckets[-1] if self.buckets else None
            if (last is None or last[0] is not comm or last[1][0].dtype != p.dtype
                    or (sum(q.numel() for q in last[1]) + p.numel()) * p.element_size() > bucket_bytes):
                self.buckets.append((comm, []))
            self.buckets[-1][1].append(p)
        self._bucket_of = {id(p): k for k, (_, ps) in enumerate(self.buckets) for p in ps}
        self.armed = False
        self.overlapped = 0
        self._ready: set = set()
        self._next = 0
        self._works: list = []
        for _, ps in self.buckets:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._hook)

    def arm(self) -> None:
        self.armed, self._ready, self._next, self._works = True, set(), 0, []

    def _hook(self, p) -> None:
        self.mark_ready(p)

    def mark_ready(self, p) -> None:
        """``p``'s gradient is final for this step (a zero-bubble W reports what no hook sees)."""
        if self.armed and id(p) in self._bucket_of:
            self._ready.add(id(p))
            self._launch(False)

    def _launch(self, everything: bool) -> None:
        while self._next < len(self.buckets):
            comm, ps = self.buckets[self._next]
            if not everything and any(id(p) not in self._ready for p in ps):
                return
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self._works.append((dist.all_reduce(flat, group=comm.pg(), async_op=True), flat, ps))
            self._next += 1

    def launch_rest(self) -> None:
        if self.armed:
            self.overlapped = self._next  # buckets the hooks launched during the action
        self._launch(True)
        self.armed = False

    def finish(self) -> None:
        self.launch_rest()
        for work, flat, ps in self._works:
            work.wait()
            off = 0
            for p in ps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
        self._works = []
