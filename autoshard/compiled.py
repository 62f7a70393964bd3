"""What ``autoshard.compile`` returns on each rank: a ``CompiledModel``, with or without a pipeline.

A ``CompiledModel`` owns this rank's program (``runtime.RankProgram``: its stages of the plan under
the plan's schedule, each a printable fx GraphModule of local ops and explicit collectives) and its
local parameter shards. ``step`` runs forward and backward over the global batch and leaves the
synchronized local gradients on ``parameters()``, which any ``torch.optim`` optimizer takes. How the
plan is made and shared between ranks is the driver's part (``autoshard.driver``).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from autoshard.passes.errors import BatchError
from autoshard.plans import Plan
from autoshard.runtime.executor import RankProgram
from autoshard.runtime.grad_clip import clip_grad_norm_
from autoshard.runtime.holdings import holdings
from autoshard.runtime.optim_state import load_optimizer_state_dict, optimizer_state_dict
from autoshard.runtime.local_module import local_module
from autoshard.runtime.memory_probe import MemoryProbe
from autoshard.runtime.pipeline.timelines import gather_timelines


class _TrainingState:
    """The training-state surface of a compiled model, read from the rank's program (``self._program``)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's local parameter shards (pass them to a torch.optim optimizer)."""
        return iter(self._program.parameters())

    def named_parameters(self):
        return iter(self._program.named_parameters())

    def full_state_dict(self) -> dict:
        """Full tensors under the original ``model.state_dict()`` names, the model's state-dict hooks
        included (collective: call on every rank)."""
        return self._program.full_state_dict()

    # ---- training-loop helpers -------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their GLOBAL norm over every rank's shards (each element counted once,
        replicated copies not once per replica); returns the norm before clipping, the same on every rank.
        Equals ``torch.nn.utils.clip_grad_norm_`` on one device; ``norm_type`` may be ``inf``. Call on every
        rank after ``step`` (``runtime.grad_clip``)."""
        if self._held is None:
            self._held = holdings(self._program)
        return clip_grad_norm_(self._held, max_norm, norm_type, error_if_nonfinite)

    @property
    def data_parallel_size(self) -> int:
        """How many distinct slices the global batch is cut into: the product of the sizes of the plan's
        data-parallel axes (the mesh axes on which every batch input is sharded on dim 0)."""
        return self._program.data_layout().size

    @property
    def data_parallel_rank(self) -> int:
        """Which slice this rank takes (what ``DistributedSampler(num_replicas=data_parallel_size,
        rank=data_parallel_rank)`` needs): rows ``[r * B / size, (r + 1) * B / size)`` of a global batch of
        ``B`` rows. Ranks along the other mesh axes share it (``runtime.local_batch``)."""
        return self._program.data_layout().rank

    # ---- checkpoints (``runtime.state_dict``, ``runtime.optim_state``) -------------------------------
    def state_dict(self) -> dict:
        """This rank's model state for ``torch.distributed.checkpoint``: DTensors with the plan's placements
        on the program's DeviceMesh (views of the live parameters), under ``model.state_dict()``'s names,
        hooks included. ``dcp.load`` into it, then ``load_state_dict`` it. Call on every rank."""
        return self._program.model_state().state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Copy ``state_dict`` into the local shards: DTensors on this program's mesh in any placements
        (what ``dcp.load`` into ``state_dict()`` gives, from any plan or mesh) or full tensors. Call on
        every rank."""
        self._program.model_state().load_state_dict(state_dict, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state keyed by parameter name (torch's flattened DCP layout:
        ``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyperparameter>``), state tensors as DTensors with
        their parameter's placements. A fresh optimizer gets its state first (a zero step at lr 0)."""
        return optimizer_state_dict(self._program.model_state(), optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict,
                                  strict: bool = True) -> None:
        """Load what ``optimizer_state_dict`` gave (after ``dcp.load``, from any plan or mesh) into
        ``optimizer``."""
        load_optimizer_state_dict(self._program.model_state(), optimizer, state_dict, strict=strict)


def ordered_inputs(captured, inputs: tuple, named: dict) -> tuple:
    """``inputs`` then ``named`` keyword inputs, in the order the program was traced with."""
    if not named:
        return inputs
    order = [n for n in captured.inputs if n != captured.target]
    unknown = sorted(set(named) - set(order))
    if unknown:
        raise BatchError(f"unknown input name(s) {unknown}; the program was traced with inputs {order}")
    positional = list(inputs)
    for name in order[len(positional):]:
        if name not in named:
            raise BatchError(f"input {name!r} is missing; the program was traced with inputs {order}")
        positional.append(named[name])
    return tuple(positional)


class CompiledModel(_TrainingState):
    """This rank's compiled model: the ``plan`` it runs (``passes.pipeline.plan.Plan``, bound to the
    program of one microbatch: without a pipeline one stage, with ``pp=`` its stages traced and sharded
    at microbatch shapes) and its ``runtime.RankProgram``. ``planner_plan``: with ``pp=``, the stage
    planner's choice it was built from (made at the shapes of one round of the batch); ``env``: a plan
    without a pipeline runs on it (default: ``setup_distributed(plan.mesh)``)."""

    def __init__(self, model: Optional[torch.nn.Module], plan: Plan, env=None, *, state_dict: Optional[dict] = None,
                 device=None, compile_seconds: float = 0.0, planner_plan=None,
                 program: Optional[RankProgram] = None, compile=None):
        self.plan = plan
        self.compile_seconds = compile_seconds
        self.planner_plan = planner_plan
        self._program = program if program is not None else RankProgram(plan, env=env, model=model, compile=compile,
                                                                         state_dict=state_dict, device=device)
        self.env = self._program.env
        #: with ``compile=``: what was compiled over this rank's stages, what stayed eager and why, what
        #: compiling cost (``runtime.compiled_regions.CompileReport``; also in ``plan.summary()``)
        self.compile_report = getattr(self._program, "compile_report", None)
        plan.compile_report = self.compile_report  # not a field: never saved
        self._held = None
        self._local_module = None

    # ---- running -------------------------------------------------------------------------------
    def step(self, *inputs, target=None, local_batch: bool = False, **named_inputs) -> float:
        """Forward and backward over the GLOBAL batch (the same full tensors on every rank), through the
        pipeline when the plan has one; returns the mean loss, identical on every rank. Gradients land on
        ``parameters()``. Inputs traced as keywords (``example_inputs={"input_ids": ...}``) may be passed
        by name. ``local_batch=True``: each rank passes only its ``data_parallel_rank``'s slice of the
        global batch instead; the step is the same."""
        return self._program.step(*self._ordered(inputs, named_inputs), target=target, local_batch=local_batch)

    def __call__(self, *inputs, target=None, local_batch: bool = False, **named_inputs):
        """Forward only, no autograd (a plan without a pipeline): the full (gathered) output on every rank,
        or, for a program traced with a loss function, the mean loss (pass ``target=``). ``local_batch`` as
        in ``step``."""
        return self._program.forward(*self._ordered(inputs, named_inputs), target=target, local_batch=local_batch)

    def _ordered(self, inputs: tuple, named: dict) -> tuple:
        return ordered_inputs(self._program.captured, inputs, named)

    # ---- inspecting ------------------------------------------------------------------------------
    @property
    def program(self) -> torch.fx.GraphModule:
        """This rank's fx program (of its one stage): ``print(cm.program.code)`` shows local ops and
        collectives."""
        return self._program.program

    def collective_counts(self) -> dict:
        """Collective calls in this rank's programs by kind (gradient syncs included)."""
        return self._program.collective_counts()

    @property
    def local_module(self) -> torch.nn.Module:
        """This rank's parameter shards and buffers as an ``nn.Module`` (the live tensors, no copies),
        for torch's memory tools: ``MemTracker().track_external(cm.local_module, optimizer)``, then
        ``cm.step(...)`` and ``optimizer.step()`` inside the tracker (``runtime.local_module``)."""
        if self._local_module is None:
            self._local_module = local_module(self._program)
        return self._local_module

    def memory_probe(self) -> MemoryProbe:
        """``with cm.memory_probe() as probe: cm.step(...)``: then ``probe.saved_bytes`` (what autograd
        kept at the end of the forward) and ``probe.gathered_peak_bytes`` (parameter copies alive at
        the peak), measured on this rank (``runtime.memory_probe``)."""
        return MemoryProbe(self._program)

    @property
    def timeline(self) -> list:
        """The last step's measured compute actions on this rank (see ``write_chrome_trace``)."""
        return self._program.timeline

    def gather_timelines(self) -> dict:
        """Every rank's measured timeline of the last step, on every rank (a collective: call it on all
        ranks). ``runtime.pipeline.timelines.draw_measured_timeline`` draws it; ``write_chrome_trace``
        writes it for chrome://tracing / Perfetto."""
        return gather_timelines(self._program.timeline)

    def to_dot(self, detail: str = "blocks") -> str:
        """The partition this rank runs as graphviz dot text (``Plan.to_dot``): with a pipeline, one
        cluster per stage with its ranks and submesh."""
        return self.plan.to_dot(detail)

    def render(self, path: str, detail: str = "blocks") -> str:
        """Draw the partition to ``path`` (.svg or .png); without graphviz's ``dot``, writes .dot and
        raises RuntimeError saying how to render it (as ``Plan.render``)."""
        return self.plan.render(path, detail)
