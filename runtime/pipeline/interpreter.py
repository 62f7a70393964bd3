"""Execute one rank group's action list for one step, recording a measured timeline.

Compute actions drive everything; communication follows the data, not the SEND/RECV actions:

- ``p2p.plan_transfers`` derives, once, from every group's compute order and the stage wiring, which
  receives each rank posts before each compute action and which sends follow it, in one global order
  every rank agrees on (NCCL-safe, see ``p2p``); a compute action waits only for its own inputs;
- an ``F(s, i)``'s outputs go to EVERY consumer stage, long skip connections included; a ``B``/``BW``'s
  input gradients go back to every producer stage; same-group consumers get a local hand-off;
- with ``prefetch = k > 0`` the receives planned for the next k actions are posted before the current
  one runs (same order), so their transfers overlap its compute (gloo starts a transfer only once its
  receive is posted). On NCCL keep ``k = 0``: a posted receive holds the pair's stream, and a send
  queued behind it could wait on its own reply.

The schedule's ``SEND_*``/``RECV_*`` actions are therefore ignored. What runs is exactly
``executed_schedule(schedule)``, which ``RankProgram`` proves deadlock-free with
``simulate.check_deadlock`` in its dependency-only mode before running: sends never wait and receives
are posted before their consumers, so no wait is added. Long skips add no new waits: ``F(s-1, i)`` done implies ``F(a, i)`` done for every ``a < s``
(and likewise for backward).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS, Action

from ..collective_watch import watching
from ..stage import LoweredStage
from .p2p import Message, Transport, Wiring, action_messages, plan_transfers

__all__ = ["Wiring", "Interpreter", "TimelineEvent", "executed_schedule"]


def executed_schedule(schedule: dict) -> dict:
    """The schedule as this runtime executes it: only its compute actions, in order. Transfers follow
    ``p2p.plan_transfers`` (each receive posted before its consumer, each send released after its
    producer), so a compute action waits for nothing but its data: exactly
    ``simulate.check_deadlock(..., require_comms=False)``."""
    return {r: [a for a in acts if a.kind in COMPUTE_KINDS] for r, acts in schedule.items()}


@dataclass(frozen=True)
class TimelineEvent:
    """One executed compute action: wall-clock seconds since the step began; ``wait``: of which spent
    blocked on its receives."""
    rank: int
    action: str
    start: float
    end: float
    wait: float = 0.0


@dataclass(frozen=True)
class _Step:
    action: Action
    needs: tuple     # (message, source stage, source rank or None when local), consumption order
    makes: tuple     # (message, destination stage, True when it leaves the group)
    sends: tuple     # (message, destination rank, tag) sent after the action
    posts: tuple     # (message, shape, dtype, source rank, tag) receives to post before it


class Interpreter:
    """Runs rank group ``group``'s part of ``schedule`` over the local ``stages`` (stage index ->
    ``stage.LoweredStage``); ``index``: this rank's position in its group. ``prefetch``: actions ahead
    whose receives are posted early (0 on NCCL)."""

    def __init__(self, stages: dict[int, LoweredStage], wiring: Wiring, group: int, index: int, rank: int,
                 device: torch.device, schedule: dict, *, prefetch: int = 0):
        self.stages, self.w, self.group, self.index, self.rank, self.device = stages, wiring, group, index, rank, device
        self.prefetch = int(prefetch)
        self._weight_ready: Optional[Callable[[int, torch.Tensor], None]] = None
        self._before_forward: Optional[Callable[[int, int], None]] = None
        self._around_weights: Optional[Callable[[int, bool, bool], None]] = None
        self.timeline: list[TimelineEvent] = []
        plan = plan_transfers(executed_schedule(schedule), wiring).get(group, [])
        for t in plan:
            if t.action.stage not in stages:
                raise RuntimeError(f"action {t.action} names stage {t.action.stage}, which rank group {group} does "
                                   f"not run (it runs {sorted(stages)})")
        self.steps = [self._step(t) for t in plan]
        last = {}
        for j, t in enumerate(plan):
            if t.action.kind in ("BW", "W"):
                last[t.action.stage] = j
        self._weights_done: dict[int, list[int]] = {}
        for s in sorted(stages):
            self._weights_done.setdefault(last.get(s, len(plan) - 1), []).append(s)

    def _step(self, t) -> _Step:
        w, g = self.w, self.group
        needs, makes = action_messages(t.action, w)
        needs = tuple((m, src, None if w.group_of[src] == g else w.peer(self.index, src)) for m, src in needs)
        makes = tuple((m, dst, w.group_of[dst] != g) for m, dst in makes)
        sends = tuple((m, w.ranks_of[h][self.index], w.tag(m)) for m, h in t.sends)
        posts = tuple((m, *w.meta[m.value], w.ranks_of[h][self.index], w.tag(m)) for m, h in t.posts)
        return _Step(t.action, needs, makes, sends, posts)

    def run(self, user_mbs: list[list], target_mbs: list, *,
            before_weights: Optional[Callable[[int], None]] = None,
            after_weights: Optional[Callable[[int], None]] = None,
            weight_ready: Optional[Callable[[int, torch.Tensor], None]] = None,
            around_weights: Optional[Callable[[int, bool, bool], None]] = None,
            losses: Optional[list] = None,
            before_forward: Optional[Callable[[int, int], None]] = None) -> list[torch.Tensor]:
        """Run the schedule once; returns the last stage's local loss pieces per microbatch (if it lives
        here), appended to ``losses`` when given (the callbacks may read it).
        ``before_weights(s)`` / ``after_weights(s)`` are called once per local stage s, right before /
        after the last action of the step that adds to its weight gradients (BW or W; the last action
        if none does): the same points on every rank of the group. ``weight_ready(s, p)``: during a
        W of stage s, as parameter p's gradient lands (a full backward's land through autograd hooks).
        ``before_forward(s, i)``: right before the forward of stage s on microbatch i (``rng_streams``).
        ``around_weights(s, after, last)``: right before (``after`` False) and after (True) every action
        of stage s that adds to its weight gradients (BW or W), ``last`` for the stage's last such
        action of this run (``runtime.zero`` reduces per microbatch around them)."""
        self._weight_ready, self._before_forward, self._around_weights = weight_ready, before_forward, around_weights
        tp = Transport(self.device)
        ready: dict[Message, torch.Tensor] = {}
        self.timeline = []
        losses = [] if losses is None else losses
        steps, ahead = self.steps, self.prefetch
        posted = 0
        t0 = time.perf_counter()
        # A failed action raises out of here without draining the sends: waiting for them could only
        # wait for the timeout again (collective_watch).
        for j, step in enumerate(steps):
            with watching(rank=self.rank, stage=step.action.stage, action=str(step.action)):
                while posted < len(steps) and posted <= j + ahead:
                    for m, shape, dtype, src, tag in steps[posted].posts:
                        tp.post_recv(m, shape, dtype, src, tag)
                    posted += 1
                self._run_step(j, step, tp, ready, user_mbs, target_mbs, losses, t0, before_weights, after_weights)
        with watching(rank=self.rank, action="the step's last sends"):
            tp.drain()
        return losses

    def _run_step(self, j: int, step: "_Step", tp: Transport, ready: dict, user_mbs, target_mbs, losses, t0: float,
                  before_weights, after_weights) -> None:
        """One scheduled action: its receives, its compute, its sends, and the weight callbacks around it."""
        if before_weights is not None:
            for s in self._weights_done.get(j, ()):
                before_weights(s)
        start = time.perf_counter()
        got = [tp.take(m) if src is None else tp.recv(m) for m, _, src in step.needs]
        waited = time.perf_counter() - start
        around = self._around_weights if step.action.kind in ("BW", "W") else None
        last = step.action.stage in self._weights_done.get(j, ())
        if around is not None:
            around(step.action.stage, False, last)
        outs = self._compute(step, got, user_mbs, target_mbs, losses)
        if around is not None:
            around(step.action.stage, True, last)
        for (m, _, remote), o in zip(step.makes, outs):
            if remote:
                ready[m] = o
            else:
                tp.put(m, o)
        for m, dst, tag in step.sends:
            tp.send(ready.pop(m), dst, tag)
        self.timeline.append(TimelineEvent(self.group, str(step.action), start - t0,
                                           time.perf_counter() - t0, waited))
        if after_weights is not None:
            for s in self._weights_done.get(j, ()):
                after_weights(s)

    # ---- one compute action --------------------------------------------------------------------
    def _compute(self, step: _Step, got: list, user_mbs, target_mbs, losses) -> list:
        """Run the action on its inputs (``step.needs`` order); returns its outputs in ``step.makes`` order."""
        a = step.action
        st, s, i = self.stages[a.stage], a.stage, a.microbatch
        if a.kind == "F":
            if self._before_forward is not None:
                self._before_forward(s, i)
            user = [user_mbs[k][i] for k in st.graph.user_inputs]
            outs = st.forward(i, user, got, target_mbs[i] if st.graph.reads_target else None)
            if st.graph.is_last:
                losses.append(outs[0].detach())
                return []
            return [o for (_, consumers), o in zip(self.w.sends[s], outs) for _ in consumers]
        if a.kind == "W":
            ready = self._weight_ready
            st.backward_weight(i, None if ready is None else lambda p: ready(s, p))
            return []
        grads = None
        if not st.graph.is_last:
            grads, it = [], iter(got)
            for v, consumers in self.w.sends[s]:
                parts = [next(it) for _ in consumers] if self.w.differentiable(v) else []
                grads.append(sum(parts[1:], parts[0]) if parts else None)
        in_grads = st.backward_input(i, grads) if a.kind == "B" else st.backward(i, grads)
        return [g for v, g in zip(self.w.receives[s], in_grads) if self.w.differentiable(v)]
