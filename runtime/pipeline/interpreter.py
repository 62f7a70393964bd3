"""Execute one rank group's action list for one step, recording a measured timeline.

Compute actions drive everything; communication follows the data, not the SEND/RECV actions:

- after ``F(s, i)`` the stage's outputs are posted at once (``isend``, or a local hand-off when the
  consumer stage lives on the same rank group) to EVERY consumer stage, long skip connections
  included; after ``B``/``BW`` the input gradients go back to every producer stage the same way;
- before a compute action, what it needs is received (blocking ``irecv``) from each producer (F)
  or consumer (B/BW).

The schedule's ``SEND_*``/``RECV_*`` actions are therefore ignored. What runs is exactly
``executed_schedule(schedule)`` (the compute order; every message has its own tag, so arrival order
never blocks), which ``PipelineProgram`` proves deadlock-free with ``simulate.check_deadlock`` in its
dependency-only mode before running. Long skips add no new waits: ``F(s-1, i)`` done implies
``F(a, i)`` done for every ``a < s`` (and likewise for backward).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from autoshard.passes.pipeline.actions import COMPUTE_KINDS, Action

from .p2p import Mailbox, message_tag
from .stage import StageProgram

__all__ = ["Wiring", "Interpreter", "TimelineEvent", "executed_schedule"]


def executed_schedule(schedule: dict) -> dict:
    """The schedule as this runtime executes it: only its compute actions, in order. Transfers are
    posted eagerly right after their producer and matched by tag (not FIFO), so a compute action
    waits for nothing but its data: exactly ``simulate.check_deadlock(..., require_comms=False)``."""
    return {r: [a for a in acts if a.kind in COMPUTE_KINDS] for r, acts in schedule.items()}


@dataclass(frozen=True)
class TimelineEvent:
    """One executed compute action: wall-clock seconds since the step began."""
    rank: int
    action: str
    start: float
    end: float


@dataclass
class Wiring:
    """Where each stage lives and what flows between stages.

    ``group_of[s]``: rank group of stage s; ``ranks_of[g]``: global ranks of group g (k-th talks to
    k-th); ``values``: global list of boundary values (node name, producer stage); ``sends[s]``:
    (value index, consumer stages) per output of s in return order; ``receives[s]``: value index per
    received input of s in placeholder order; ``meta[v]``: (shape, dtype) of value v per microbatch.
    """
    group_of: list[int]
    ranks_of: dict[int, list[int]]
    values: list[tuple[str, int]]
    sends: dict[int, list[tuple[int, list[int]]]]
    receives: dict[int, list[int]]
    meta: list[tuple]
    microbatches: int
    n_stages: int = field(init=False)

    def __post_init__(self):
        self.n_stages = len(self.group_of)

    def peer(self, my_group: int, my_index: int, other_stage: int) -> int:
        return self.ranks_of[self.group_of[other_stage]][my_index]


class Interpreter:
    """Runs ``actions`` (this group's list) over the local ``stages`` (stage index -> StageProgram)."""

    def __init__(self, stages: dict[int, StageProgram], wiring: Wiring, group: int, index: int, rank: int,
                 device: torch.device):
        self.stages, self.w, self.group, self.index, self.rank, self.device = stages, wiring, group, index, rank, device
        self.timeline: list[TimelineEvent] = []

    def run(self, actions: list[Action], user_mbs: list[list], target_mbs: list) -> list[torch.Tensor]:
        """Run one step; returns the last stage's local loss pieces per microbatch (if it lives here)."""
        box = Mailbox()
        self.timeline = []
        losses: list = []
        t0 = time.perf_counter()
        try:
            for a in actions:
                if a.kind not in COMPUTE_KINDS:
                    continue
                if a.stage not in self.stages:
                    raise RuntimeError(f"action {a} names stage {a.stage}, which rank group {self.group} does not "
                                       f"run (it runs {sorted(self.stages)})")
                start = time.perf_counter() - t0
                self._compute(a, box, user_mbs, target_mbs, losses)
                self.timeline.append(TimelineEvent(self.group, str(a), start, time.perf_counter() - t0))
        finally:
            box.drain()
        return losses

    # ---- one compute action --------------------------------------------------------------------
    def _tag(self, kind: str, value: int, consumer: int, mb: int) -> int:
        return message_tag(kind, value, consumer, mb, self.w.n_stages, self.w.microbatches)

    def _compute(self, a: Action, box: Mailbox, user_mbs, target_mbs, losses) -> None:
        st, s, i = self.stages[a.stage], a.stage, a.microbatch
        if a.kind == "F":
            received = [self._get(box, "act", v, s, i, self.w.values[v][1]) for v in self.w.receives[s]]
            user = [user_mbs[k][i] for k in st.graph.user_inputs]
            outs = st.forward(i, user, received, target_mbs[i] if st.graph.reads_target else None)
            if st.graph.is_last:
                losses.append(outs[0].detach())
            else:
                for (v, consumers), o in zip(self.w.sends[s], outs):
                    for c in consumers:
                        self._put(box, "act", v, c, i, o, c)
            return
        if a.kind == "W":
            st.backward_weight(i)
            return
        grads = None
        if not st.graph.is_last:
            grads = []
            for v, consumers in self.w.sends[s]:
                parts = [self._get(box, "grad", v, c, i, c) for c in consumers if self._differentiable(v)]
                grads.append(sum(parts[1:], parts[0]) if parts else None)
        in_grads = st.backward_input(i, grads) if a.kind == "B" else st.backward(i, grads)
        for v, g in zip(self.w.receives[s], in_grads):
            if g is not None:
                self._put(box, "grad", v, s, i, g, self.w.values[v][1])

    def _differentiable(self, v: int) -> bool:
        return self.w.meta[v][1].is_floating_point

    def _put(self, box: Mailbox, kind: str, v: int, consumer: int, mb: int, t: torch.Tensor, dest_stage: int) -> None:
        if self.w.group_of[dest_stage] == self.group:
            box.put((kind, v, consumer, mb), t)
        else:
            box.send(t, self.w.peer(self.group, self.index, dest_stage), self._tag(kind, v, consumer, mb))

    def _get(self, box: Mailbox, kind: str, v: int, consumer: int, mb: int, src_stage: int) -> torch.Tensor:
        if self.w.group_of[src_stage] == self.group:
            return box.take((kind, v, consumer, mb))
        shape, dtype = self.w.meta[v]
        return box.recv(shape, dtype, self.device, self.w.peer(self.group, self.index, src_stage),
                        self._tag(kind, v, consumer, mb))
