"""What ``autoshard.compile`` returns on each rank: ``CompiledModel``, or ``PipelinedModel`` for a pipeline.

A ``CompiledModel`` owns this rank's program (a printable fx GraphModule of local ops and explicit
collectives) and its local parameter shards. ``step`` runs forward and backward over the global
batch and leaves the synchronized local gradients on ``parameters()``, which any ``torch.optim``
optimizer takes. How the plan is made and shared between ranks is ``autoshard.api.compile``'s part.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from autoshard.drawing import pipeline_to_dot, render_dot
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
    """The state surface both compiled kinds share, read from the rank's program (``self._program``)."""

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
    def __init__(self, model: torch.nn.Module, plan: Plan, env, *, state_dict: Optional[dict] = None,
                 compile_seconds: float = 0.0, planner_plan=None, compile=None):
        self.plan = plan
        self.env = env
        self.compile_seconds = compile_seconds
        #: with ``pp="auto"``: the stage planner's ``PipelinePlan`` (here pp == 1: it chose no pipeline)
        self.planner_plan = planner_plan
        self._program = RankProgram(plan.captured, plan.solution.strategies, plan.mesh, env=env,
                                    model=model, state_dict=state_dict, levers=plan.solution.levers,
                                    compile=compile)
        #: with ``compile=``: what was compiled, what stayed eager and why, what compiling cost (also in
        #: ``plan.summary()``); filled in as regions compile at the first step
        self.compile_report = self._program.compile_report
        plan.compile_report = self.compile_report
        self._held = None
        self._local_module = None

    # ---- running -------------------------------------------------------------------------------
    def step(self, *inputs, target=None, local_batch: bool = False, **named_inputs) -> float:
        """Forward and backward over the GLOBAL batch (the same full tensors on every rank); returns the
        mean loss, identical on every rank. Gradients land on ``parameters()``. Inputs traced as keywords
        (``example_inputs={"input_ids": ...}``) may be passed by name. ``local_batch=True``: each rank
        passes only its ``data_parallel_rank``'s slice of the global batch instead; the step is the same."""
        return self._program.step(*self._ordered(inputs, named_inputs), target=target, local_batch=local_batch)

    def __call__(self, *inputs, target=None, local_batch: bool = False, **named_inputs):
        """Forward only, no autograd: the full (gathered) output on every rank, or, for a program traced
        with a loss function, the mean loss (pass ``target=``). ``local_batch`` as in ``step``."""
        return self._program.forward(*self._ordered(inputs, named_inputs), target=target, local_batch=local_batch)

    def _ordered(self, inputs: tuple, named: dict) -> tuple:
        return ordered_inputs(self.plan.captured, inputs, named)

    # ---- inspecting ------------------------------------------------------------------------------
    @property
    def program(self) -> torch.fx.GraphModule:
        """This rank's fx program: ``print(cm.program.code)`` shows local ops and collectives."""
        return self._program.program

    def collective_counts(self) -> dict:
        """Collective calls in this rank's program by kind (gradient syncs included)."""
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


# ---- pipeline parallelism ----------------------------------------------------------------------

class PipelinedModel(_TrainingState):
    """What ``autoshard.compile(..., pp=...)`` returns on each rank when the plan pipelines: this rank's
    stages (``runtime.pipeline.PipelineProgram``), the runtime ``plan`` (stages traced and sharded at
    microbatch shapes) and ``planner_plan``, the stage planner's choice it was built from (made at
    global-batch shapes). Same training surface as ``CompiledModel``."""

    def __init__(self, plan, program, *, compile_seconds: float = 0.0, planner_plan=None):
        self.plan, self._program, self.compile_seconds = plan, program, compile_seconds
        self.planner_plan = planner_plan
        plan.compile_report = program.compile_report

    @property
    def compile_report(self):
        """With ``compile=``: what was compiled over this rank's stages, what stayed eager and why, what
        compiling cost (``runtime.compiled_regions.CompileReport``); None otherwise."""
        return self._program.compile_report
        self._held = None

    def step(self, *inputs, target=None, local_batch: bool = False, **named_inputs) -> float:
        """Forward and backward of the GLOBAL batch through the pipeline; the mean loss on every rank.
        Inputs traced as keywords (``example_inputs={"input_ids": ...}``) may be passed by name.
        ``local_batch=True``: each rank passes only its ``data_parallel_rank``'s slice instead."""
        return self._program.step(*ordered_inputs(self._program.captured, inputs, named_inputs), target=target,
                                  local_batch=local_batch)

    @property
    def timeline(self) -> list:
        """The last step's measured compute actions on this rank (see ``write_chrome_trace``)."""
        return self._program.timeline

    def gather_timelines(self) -> dict:
        """Every rank's measured timeline of the last step, on every rank (a collective: call it on all
        ranks). ``runtime.pipeline.timelines.draw_measured_timeline`` draws it; ``write_chrome_trace``
        writes it for chrome://tracing / Perfetto."""
        return gather_timelines(self._program.timeline)

    def to_dot(self) -> str:
        """The partition as graphviz dot text: one cluster per stage with its ranks and submesh."""
        return pipeline_to_dot(self.plan, self._program.captured)

    def render(self, path: str) -> str:
        """Draw the partition to ``path`` (.svg or .png); without graphviz's ``dot``, writes .dot and
        raises RuntimeError saying how to render it (as ``Plan.render``)."""
        return render_dot(self.to_dot(), path)
