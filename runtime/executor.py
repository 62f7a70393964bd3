"""``RankProgram``: one rank's lowered program, its local shards, and the training step.

Built once from a captured graph, the plan's strategies and the mesh::

    rp = RankProgram(captured, strategies, (2, 2), model=model)     # under torchrun, every rank
    opt = torch.optim.AdamW(rp.parameters(), lr=1e-3)               # local shards
    loss = rp.step(x, target=y); opt.step(); opt.zero_grad()        # the full global batch on every rank
    print(rp.program.code)                                          # local ops + named collectives

``step`` runs forward and backward over the global batch: every rank receives the same full
inputs and keeps its own chunk; the program returns the loss as ``P`` on every axis, backward
starts from it with seed 1, replicated parameters' gradients are all-reduced (``gradsync``), and
the returned loss is the all-reduced sum of the local values, identical on every rank.

The plan's memory levers (``passes.levers.Levers``) act here:

- ``accumulation`` k: the program is traced at the microbatch (global batch / k); ``step`` takes
  the global batch, cuts every input and the target into k slices along dim 0 and runs k forward +
  backward microsteps, each backward seeded 1/k; the gradient all-reduce is armed for the last
  microstep only (the others' gradients are part of the sum it reduces); returns the mean loss;
- block policies: checkpointed block instances run as ``regions.CheckpointRegion``; parameter
  groups that reshard after forward are packed as handles while the forward runs
  (``param_gather.ParamGatherer.saved_tensors_hooks``);
- ``mixed_precision``: the program (traced with parameters in ``param_dtype``) receives the master
  weights and casts its parameter copies; floating inputs are cast to the traced dtype; replicated
  gradients are all-reduced in ``reduce_dtype`` (``param_dtype`` when None), sharded ones
  reduce-scattered in it by the parameter gathers.

``compile`` (a ``compile_backend.CompileOptions``): the program's collectives become functional
(``functional_collectives``) and its traceable runs ``torch.compile``'d regions (``compiled_regions``);
``compile_report`` says what was compiled, what stayed eager and why, and what compiling cost.

``memory_probe`` (a ``memory_probe.MemoryProbe`` while one is active) measures a step.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autoshard.passes.errors import BatchError, MeshError
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.layout.shapes import local_shape, normalize
from autoshard.passes.levers import Levers
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Replicate, Strategy, TensorMeta

from .compile_backend import CompileOptions, RegionCompiler
from .compiled_regions import compile_regions
from .functional_collectives import functionalize
from .gradsync import GradSync
from .groups import MeshEnv, setup_distributed
from .local_batch import DataLayout, InputCheck, arrivals_for, data_layout, local_shapes, user_inputs
from .lower import COLLECTIVE_META, PARAM_STEPS_META, lower
from .materialize import materialize
from .regions import outline_regions
from .state_dict import ModelState

__all__ = ["RankProgram"]


class RankProgram:
    """This rank's program and state. See the module docstring.

    ``env``: a ``MeshEnv`` (default: ``setup_distributed(mesh)``). Initial values come from
    ``state_dict`` (full tensors, original names), else ``model``'s real tensors, else, for a
    meta-device model, initialization replayed with ``seed`` (see ``materialize``).
    ``bucket_mb``/``first_bucket_mb`` size the gradient all-reduce buckets. ``levers``: the plan's
    memory levers (default: none pulled; see the module docstring).
    """

    def __init__(self, captured: CapturedGraph, strategies: dict[str, Strategy], mesh: Any, *,
                 env: Optional[MeshEnv] = None, model: Optional[nn.Module] = None,
                 state_dict: Optional[dict] = None, seed: int = 0, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, levers: Optional[Levers] = None,
                 compile: Optional[CompileOptions] = None):
        mesh = Mesh.of(mesh)
        self.env = env if env is not None else setup_distributed(mesh)
        if self.env.mesh.shape != mesh.shape:
            raise MeshError(f"the plan is for mesh {mesh.shape} but the process groups were built for "
                            f"{self.env.mesh.shape}; call setup_distributed with the plan's mesh")
        self.captured, self.strategies, self.mesh = captured, strategies, mesh
        self.levers = levers if levers is not None else Levers()
        self.compiler = RegionCompiler(compile, self.env.device) if compile is not None else None
        self._bucket_bytes = int(bucket_mb * 2**20)
        self.program, self.gatherer = self._build_program()
        self._full = (self.program, self.gatherer)
        self._local: Optional[tuple] = None  # the program taking this rank's slice (``local_batch``)
        self.memory_probe = None

        local = materialize(captured, strategies, self.env, model=model, state_dict=state_dict, seed=seed)
        trainable = self._trainable(model)
        self._param_names = list(captured.params)
        self._buffer_names = list(captured.buffers)
        self._params = [nn.Parameter(local[ph], requires_grad=trainable.get(ph, True)) for ph in self._param_names]
        self._buffers = [local[ph] for ph in self._buffer_names]
        self.model = model  # its state_dict hooks name the checkpoint's tensors (``state_dict.ModelState``)
        self._model_state: Optional[ModelState] = None
        self._data_layout: Optional[DataLayout] = None

        entries = list(captured.inputs) + ([captured.target] if captured.target is not None else [])
        self._inputs = [(name, captured.node(name).meta.get(META)) for name in entries]
        self._loss_comm = self.env.comm_for([a for a, s in enumerate(mesh.shape) if s > 1])
        mp = self.levers.mixed_precision
        # a forward-only program never has gradients: no buckets for them
        self._sync = GradSync(self._sync_order() if captured.loss_output else [], bucket_bytes=int(bucket_mb * 2**20),
                              first_bucket_bytes=int(first_bucket_mb * 2**20), carry_comm=self._loss_comm,
                              reduce_dtype=None if mp is None else (mp.reduce_dtype or mp.param_dtype))

    # ---- construction helpers ------------------------------------------------------------------
    def _trainable(self, model) -> dict[str, bool]:
        if model is None:
            return {}
        flags = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
        return {ph: flags.get(fqn, True) for ph, fqn in self.captured.params.items()}

    def _build_program(self, arrivals: Optional[dict] = None) -> tuple:
        """(program, its parameter gatherer or None): lowered with the levers, checkpointed block
        instances outlined as regions; ``arrivals`` for the ``local_batch`` variant."""
        flat = lower(self.captured, self.strategies, self.env, self.levers, arrivals=arrivals)
        gatherer = getattr(flat, "param_gatherer", None)
        if self.compiler is not None:
            functionalize(flat)
        program = outline_regions(flat, lambda b: self.levers.policy(b).checkpoint, set(self.captured.buffers))
        if self.compiler is not None:
            compile_regions(program, self.compiler, self._synced_bytes(), self._bucket_bytes)
        return program, gatherer

    def _synced_bytes(self) -> dict:
        """Placeholder name -> local bytes of each parameter whose gradient ``GradSync`` all-reduces."""
        out = {}
        for ph in self.captured.params:
            storage = normalize(self.strategies[ph].outputs[0], self.mesh.shape)
            if any(isinstance(p, Replicate) and self.mesh.shape[a] > 1 for a, p in enumerate(storage)):
                meta = self.captured.node(ph).meta[META]
                shape = local_shape(meta.shape, storage, self.mesh.shape)
                out[ph] = math.prod(shape) * meta.dtype.itemsize
        return out

    @property
    def compile_report(self):
        """The current program's ``compiled_regions.CompileReport`` (None when not compiled)."""
        return getattr(self.program, "compile_report", None)

    def _sync_order(self) -> list:
        """(param, comm over its R axes) in the order gradients become ready: reverse first use."""
        first_use: dict[str, int] = {}
        for i, node in enumerate(self.captured.gm.graph.nodes):
            for a in node.all_input_nodes:
                if a.name in self.captured.params:
                    first_use.setdefault(a.name, i)
        order = sorted(range(len(self._param_names)),
                       key=lambda k: -first_use.get(self._param_names[k], -1))
        out = []
        for k in order:
            storage = normalize(self.strategies[self._param_names[k]].outputs[0], self.mesh.shape)
            axes = [a for a, p in enumerate(storage) if isinstance(p, Replicate) and self.mesh.shape[a] > 1]
            if axes:
                out.append((self._params[k], self.env.comm_for(axes)))
        return out

    # ---- running -------------------------------------------------------------------------------
    def _args(self, inputs: tuple, target, shapes: Optional[dict] = None) -> list[list]:
        """The program's arguments for each microstep (one list per microstep), checked against the
        traced shapes (or ``shapes``: this rank's slice with ``local_batch``)."""
        has_target = self.captured.target is not None
        user = self._inputs[:len(self._inputs) - has_target]
        if len(inputs) != len(user):
            raise BatchError(f"the program was traced with {len(user)} input(s) {[n for n, _ in user]} "
                             f"but got {len(inputs)}")
        k = self.levers.accumulation
        if has_target and target is None:
            shape = getattr(self._inputs[-1][1], "shape", None)
            raise BatchError(f"the program was traced with a loss: pass target= (the full global target of "
                             f"shape {self._global_shape(shape) if shape else '?'})")
        if not has_target and target is not None:
            raise BatchError("the program was traced without a loss function; call it without target=")
        inputs = tuple(inputs) + ((target,) if has_target else ())
        cast = self.levers.mixed_precision is not None
        micro: list[list] = [[] for _ in range(k)]
        for (name, meta), x in zip(self._inputs, inputs):
            if not isinstance(meta, TensorMeta):
                for m in micro:
                    m.append(x)
                continue
            if not isinstance(x, torch.Tensor):
                raise BatchError(f"input {name!r} must be a tensor of shape {self._global_shape(meta.shape)}, "
                                 f"got {type(x).__name__}")
            if shapes is not None and tuple(x.shape) != shapes[name]:
                raise BatchError(f"input {name!r} has shape {tuple(x.shape)}; with local_batch=True this rank "
                                 f"passes its slice of the global batch {meta.shape}: shape {shapes[name]} (rows "
                                 f"of data_parallel_rank {self.data_layout().rank} of {self.data_layout().size})")
            if shapes is None and tuple(x.shape) != self._global_shape(meta.shape):
                raise BatchError(f"input {name!r} has shape {tuple(x.shape)} but the program was traced with the "
                                 f"global batch {self._global_shape(meta.shape)}"
                                 + (f" (microbatch {meta.shape} x {k} accumulation steps)" if k > 1 else "")
                                 + "; pass the full global batch of the traced shape on every rank, or only this "
                                   "rank's slice with local_batch=True (or compile again for a new shape)")
            if x.device != self.env.device:
                x = x.to(self.env.device, non_blocking=True)
            if cast and x.is_floating_point() and meta.dtype.is_floating_point and x.dtype != meta.dtype:
                x = x.to(meta.dtype)
            b = meta.shape[0] if meta.shape else 0
            for i, m in enumerate(micro):
                m.append(x if k == 1 else x.narrow(0, i * b, b))
        return micro

    def _global_shape(self, shape) -> tuple:
        k = self.levers.accumulation
        return tuple(shape) if k == 1 or not shape else (shape[0] * k,) + tuple(shape[1:])

    def _local_loss(self, out) -> torch.Tensor:
        return out[0] if isinstance(out, (tuple, list)) else out

    def _prepared(self, inputs: tuple, target, local_batch: bool) -> list[list]:
        """Each microstep's arguments, with the matching program made current: the full-batch program,
        or with ``local_batch`` the one taking this rank's slice (``local_batch.py``; lowered on first
        use), after checking the slices agree where they must."""
        if not local_batch:
            self.program, self.gatherer = self._full
            return self._args(inputs, target)
        if self.levers.accumulation > 1:
            raise BatchError("local_batch=True with gradient accumulation is not supported yet: pass the full "
                             "global batch (local_batch=False), or compile without accumulation=")
        if self._local is None:
            layout = self.data_layout()
            self._local = self._build_program(arrivals_for(layout, self.mesh.ndim))
            self._input_check = InputCheck(layout, self.env)
        self.program, self.gatherer = self._local
        micro = self._args(inputs, target, shapes=local_shapes(self.captured, self.data_layout()))
        self._input_check([(name, x) for (name, _), x in zip(self._inputs, micro[0]) if isinstance(x, torch.Tensor)])
        return micro

    def data_layout(self) -> DataLayout:
        """The plan's data-parallel axes and this rank's place along them (``local_batch.DataLayout``)."""
        if self._data_layout is None:
            self._data_layout = data_layout([(self.captured, self.strategies, user_inputs(self.captured))], self.mesh,
                                            self.env.coordinate)
        return self._data_layout

    def _run(self, args: list):
        """The program on one microstep's arguments, under the reshard hooks (and the probe, if any)."""
        if self.gatherer is not None:
            self.gatherer.begin()
        probe = (self.memory_probe.forward(self._params + self._buffers + list(args))
                 if self.memory_probe is not None else contextlib.nullcontext())
        hooks = self.gatherer.saved_tensors_hooks() if self.gatherer is not None else contextlib.nullcontext()
        with probe, hooks:
            return self.program(*self._params, *self._buffers, *args)

    def step(self, *inputs, target=None, local_batch: bool = False) -> float:
        """Forward + backward over the global batch (``accumulation`` microsteps); gradients land on
        ``parameters()``. Returns the mean loss (identical on every rank). With ``local_batch``, each rank
        passes only its data-parallel slice (``local_batch.py``)."""
        if not self.captured.loss_output:
            raise BatchError("step() needs a program traced with a loss function (loss_fn=...); "
                             "this one returns outputs: call forward()")
        micro = self._prepared(inputs, target, local_batch)
        k = len(micro)
        self._sync.set_aside()
        local_sum = None
        try:
            for i, args in enumerate(micro):
                last = i == k - 1
                loss = self._local_loss(self._run(args))
                local_sum = loss.detach().clone() if local_sum is None else local_sum + loss.detach()
                work = None
                if last:
                    total = local_sum / k if k > 1 else local_sum
                    self._sync.arm()
                    if self._sync.carries:  # the loss rides in a gradient bucket reduced over every axis
                        self._sync.carry(total)
                    elif self._loss_comm.size > 1:
                        work = dist.all_reduce(total, group=self._loss_comm.group, async_op=True)
                if last:
                    try:
                        self._backward(loss, k)
                    finally:
                        self._sync.finish()
                else:
                    self._backward(loss, k)
        finally:
            if self.gatherer is not None:
                self.gatherer.end()
        if self._sync.carries:
            total = self._sync.carried()
        elif work is not None:
            work.wait()
        return total.item()

    def _backward(self, loss: torch.Tensor, k: int) -> None:
        if k == 1:
            loss.backward()
        else:
            loss.backward(torch.full_like(loss, 1.0 / k))

    def forward(self, *inputs, target=None, local_batch: bool = False):
        """Forward only, without autograd: the full outputs (the loss, all-reduced, for a loss program;
        with accumulation, the mean loss over the microbatches or the outputs concatenated on dim 0),
        in the model's own output object when capture recorded one (``captured.output_structure``).
        ``local_batch``: as in ``step``; the outputs are still the full batch's."""
        micro = self._prepared(inputs, target, local_batch)
        outs = []
        with torch.no_grad():
            for args in micro:
                outs.append(self.program(*self._params, *self._buffers, *args))
            if self.gatherer is not None:
                self.gatherer.end()
            structure = self.captured.output_structure
            if not self.captured.loss_output and structure is not None:  # the model's own output object
                parts = [list(o) if isinstance(o, (tuple, list)) else [o] for o in outs]
                return structure.rebuild(p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts))
            if not self.captured.loss_output:
                outs = [o[0] if isinstance(o, (tuple, list)) and len(o) == 1 else o for o in outs]
                if len(outs) == 1:
                    return outs[0]
                if isinstance(outs[0], (tuple, list)):
                    return type(outs[0])(torch.cat(parts) for parts in zip(*outs))
                return torch.cat(outs)
            loss = sum(self._local_loss(o) for o in outs) / len(outs) if len(outs) > 1 else self._local_loss(outs[0])
            loss = loss.clone()
            if self._loss_comm.size > 1:
                dist.all_reduce(loss, group=self._loss_comm.group)
            return loss

    __call__ = forward

    # ---- state ---------------------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(self.captured.params[ph], p) for ph, p in zip(self._param_names, self._params)]

    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(self.captured.buffers[ph], b) for ph, b in zip(self._buffer_names, self._buffers)]

    def model_state(self) -> ModelState:
        """The model's state over this program under ``model.state_dict()``'s names (built once)."""
        if self._model_state is None:
            self._model_state = ModelState(self, self.model)
        return self._model_state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the original ``model.state_dict()`` names (tied aliases and the model's
        state-dict hooks included). A collective: call it on every rank."""
        return self.model_state().full_state_dict()

    # ---- inspecting ----------------------------------------------------------------------------
    def collective_counts(self) -> dict[str, int]:
        """Collective steps in the forward program by kind (a parameter gather counts its members'
        steps; a fused member, gathered over several axes flattened, one all-gather), plus
        ``grad_sync`` (parameters whose gradient is all-reduced) and ``grad_sync_buckets`` (the
        all-reduce calls doing it)."""
        counts: dict[str, int] = {}
        for module in self.program.modules():
            if not isinstance(module, fx.GraphModule):
                continue
            for node in module.graph.nodes:
                kinds = [node.meta[COLLECTIVE_META]] if node.meta.get(COLLECTIVE_META) else []
                for kind in kinds + list(node.meta.get(PARAM_STEPS_META, ())):
                    counts[kind] = counts.get(kind, 0) + 1
        if self._sync.num_params:
            counts["grad_sync"] = self._sync.num_params
            counts["grad_sync_buckets"] = len(self._sync.buckets)
        return counts
