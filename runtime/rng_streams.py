"""Random numbers a pipelined step draws as one device draws them.

One device runs a step's microbatches in order, each through the whole model, from one generator:
its stream is stage 0's draws for microbatch 0, stage 1's for microbatch 0, ..., stage 0's for
microbatch 1, and so on. A pipeline runs the (stage, microbatch) forwards on different ranks, in
its schedule's order, each rank with its own generator, so without care every stage would start
from the same state and a later stage would redraw the numbers an earlier one used (diffusers'
DiT draws its label dropout in every block).

``MicrobatchStreams`` puts each forward where one device's stream is at that point. At the start of
a step it takes the generator's state (the same on every rank when every rank seeds alike, as one
device has one stream) and walks one device's order: for every (microbatch, stage) it notes the
state if this rank runs that forward, then advances the generator by that stage's draws
(``DrawReplay``: each random op of the stage's traced program, the ops tagged
``nondeterministic_seeded``, called on stand-in operands of its traced shapes; a generator advances
by what an op draws, which depends on shapes, not values). ``enter(stage, mb)`` before a forward puts
its state in; ``end()`` leaves the generator where one device's is after the step. A program without
random ops costs nothing. Each rank replays every stage's draws (the random numbers of the whole
model for the global batch, not its compute); a draw whose count depends on values (``multinomial``
without replacement), or one inside an opaque call, is not replayed exactly.

Random ops a plan shards (dropout on a split activation) draw each rank's piece from that state: the
same distribution as one device, not the same numbers (``passes/sharding/rules/elementwise.py``);
replicated ones (DiT's ``torch.rand(batch) < p``) draw exactly one device's numbers.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.spec import TensorMeta

from .localize import rewrite_devices

__all__ = ["DrawReplay", "MicrobatchStreams", "random_nodes"]


def random_nodes(captured: CapturedGraph) -> list[fx.Node]:
    """The ops of ``captured`` that draw from the generator, in graph order."""
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"
            and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


class DrawReplay:
    """A program's random draws without its compute: ``advance()`` moves the generators by exactly what
    one run of the program draws."""

    def __init__(self, captured: CapturedGraph, device: torch.device):
        self.calls = []
        for node in random_nodes(captured):
            args, kwargs = rewrite_devices(node.args, dict(node.kwargs), device)
            self.calls.append((node.target, args, kwargs))
        self.device = device

    def __bool__(self) -> bool:
        return bool(self.calls)

    def _stand_in(self, a):
        if isinstance(a, fx.Node):
            meta = a.meta.get(META)
            if not isinstance(meta, TensorMeta):
                raise RuntimeError(f"cannot replay a random op's operand {a.name}: it is not one tensor")
            fill = 0.5 if meta.dtype.is_floating_point else 0  # a valid probability for bernoulli
            return torch.full(tuple(meta.shape), fill, dtype=meta.dtype, device=self.device)
        if isinstance(a, (list, tuple)):
            return type(a)(self._stand_in(x) for x in a)
        return a

    def advance(self) -> None:
        with torch.no_grad():
            for target, args, kwargs in self.calls:
                target(*self._stand_in(args), **{k: self._stand_in(v) for k, v in kwargs.items()})


class MicrobatchStreams:
    """Generator states for this rank's (stage, microbatch) forwards, as one device would have them.

    ``stages``: every stage's traced program in stage order (all stages, not only this rank's);
    ``local``: the stages this rank runs; ``microbatches``: per step."""

    def __init__(self, stages: Sequence[CapturedGraph], local: Sequence[int], microbatches: int,
                 device: torch.device):
        self.replays = [DrawReplay(c, device) for c in stages]
        self.local, self.microbatches, self.device = set(local), int(microbatches), torch.device(device)
        self.active = any(self.replays)
        self.states: dict[tuple[int, int], tuple] = {}
        self.final = None

    def _get(self) -> tuple:
        if self.device.type == "cuda":
            return torch.get_rng_state(), torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state(), None

    def _set(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def begin(self) -> None:
        """At the start of a step: every local forward's state, from the generator's current one."""
        if not self.active:
            return
        self.states = {}
        for mb in range(self.microbatches):
            for s, replay in enumerate(self.replays):
                if s in self.local:
                    self.states[(s, mb)] = self._get()
                if replay:
                    replay.advance()
        self.final = self._get()

    def enter(self, stage: int, microbatch: int) -> None:
        """Before the forward of ``stage`` on ``microbatch``: one device's state at that point."""
        if self.active:
            self._set(self.states[(stage, microbatch)])

    def end(self) -> None:
        """After the step: the state one device has after all microbatches."""
        if self.active and self.final is not None:
            self._set(self.final)
