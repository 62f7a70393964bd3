"""What a step or a forward returns: the mean loss reduced over the ranks, or the model's outputs.

``LossReduction``: the step's mean loss on every rank. Without a pipeline (``loss_comm`` given, the
communicator over every mesh axis): this rank's loss pieces are summed and divided by the
microbatches (or weighed by ``weights``: ``runtime.step_weights``) when the last weight-gradient
action starts (``start_alone``), then carried in a
gradient bucket reduced over every axis (``gradsync.GradSync.carry``), or all-reduced alone. A
pipeline (``loss_comm`` None): the last stage's group sums its pieces in float64 and all-reduces them
over the world with the other ranks' zero share, which ``early`` posts when the step begins (gloo:
nobody waits for it at the end) or at the end (NCCL).

``assembled``: a forward's microbatch outputs as the model returns them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from autoshard.passes.graph import CapturedGraph

from .collective_watch import note
from .collectives import AxisComm
from .gradsync import GradSync

__all__ = ["LossReduction", "assembled", "weighted_mean"]


class LossReduction:
    """One step's loss over ``n`` microbatches (see the module docstring). ``holds``: this rank runs
    the last stage."""

    def __init__(self, n: int, device, loss_comm: Optional[AxisComm], holds: bool, *, early: bool = False,
                 weights: Optional[list[float]] = None):
        self.n, self.comm, self.holds, self.early = n, loss_comm, holds, early
        self.weights = weights  # microbatch i's share of the mean (``runtime.step_weights``); None: 1 / n each
        self.total, self.work, self.sync = None, None, None
        if loss_comm is None:
            self.total = torch.zeros((), dtype=torch.float64, device=device)
            if early and not holds:
                self.work = dist.all_reduce(self.total, async_op=True)

    def start_alone(self, losses: list, sync: GradSync) -> None:
        """Without a pipeline: the local mean of ``losses``, carried in ``sync``'s bucket or all-reduced."""
        if self.weights is not None:
            self.total = weighted_mean([x.detach() for x in losses], self.weights)
        else:
            total = losses[0].detach().clone()
            for x in losses[1:]:
                total = total + x.detach()
            self.total = total / self.n if self.n > 1 else total
        if sync.carries:  # the loss rides in a gradient bucket reduced over every axis
            self.sync = sync
            sync.carry(self.total)
        elif self.comm.size > 1:
            self.work = dist.all_reduce(self.total, group=self.comm.group, async_op=True)

    def result(self, losses: list) -> float:
        """The mean loss, the same float on every rank (after the step's gradient syncs finished)."""
        if self.comm is not None:
            if self.total is None:  # no backward armed the reduction (a stage without weights)
                self.start_alone(losses, GradSync([]))
            total = self.sync.carried() if self.sync is not None else self.total
            note("all_reduce of the step's loss", self.comm)
            if self.work is not None:
                self.work.wait()
            return total.item()
        note("all_reduce of the step's loss", "over the world")
        if self.holds:
            if self.weights is not None:
                self.total += weighted_mean([x.double() for x in losses], self.weights)
            else:
                for x in losses:
                    self.total += x.double()
            self.work = dist.all_reduce(self.total, async_op=self.early)
        elif self.work is None:  # NCCL: the zero share joins at the end
            self.work = dist.all_reduce(self.total, async_op=False)
        if self.work is not None:
            self.work.wait()
        return self.total.item() / (1 if self.weights is not None else self.n)


def weighted_mean(losses: list, weights: list[float]) -> torch.Tensor:
    """``sum(w_i * loss_i)``; a microbatch of weight 0 (all its targets ignored: its mean is NaN) adds nothing."""
    total = torch.zeros_like(losses[0])
    for x, w in zip(losses, weights):
        if w:
            total = total + x * w
    return total


def assembled(captured: CapturedGraph, outs: list, loss_comm: Optional[AxisComm],
              weights: Optional[list[float]] = None):
    """A forward's microbatch outputs ``outs`` as the model returns them: for a loss program the mean
    loss (``weights``: each microbatch's share, ``runtime.step_weights``) all-reduced over ``loss_comm``; else the outputs (concatenated on dim 0 over microbatches), in
    the model's own output object when capture recorded one (``captured.output_structure``)."""
    structure = captured.output_structure
    if not captured.loss_output and structure is not None:  # the model's own output object
        parts = [list(o) if isinstance(o, (tuple, list)) else [o] for o in outs]
        return structure.rebuild(p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts))
    if not captured.loss_output:
        outs = [o[0] if isinstance(o, (tuple, list)) and len(o) == 1 else o for o in outs]
        if len(outs) == 1:
            return outs[0]
        if isinstance(outs[0], (tuple, list)):
            return type(outs[0])(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)
    local = [o[0] if isinstance(o, (tuple, list)) else o for o in outs]
    if weights is not None:
        loss = weighted_mean(local, weights)
    else:
        loss = (sum(local) / len(local) if len(local) > 1 else local[0]).clone()
    if loss_comm is not None and loss_comm.size > 1:
        dist.all_reduce(loss, group=loss_comm.group)
    return loss
