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
