"""Point-to-point transfers between pipeline stages, in one canonical order per pair of rank groups.

Boundary layout: a value crosses stages at the placement its producer's plan gives it
(``boundaries``): the k-th rank of the sending group sends its own piece to the k-th rank of the
receiving group (groups split the mesh's first axis; those of one submesh shape put their k-th ranks
at the same coordinate), which feeds it to its program as an arrival. A value read by a group of
another submesh shape travels full (``R``). Gradients go back on the same pairs, in the gradient
convention's terms (``boundaries``).

Order. NCCL ignores tags: it matches the n-th send from A to B with the n-th receive B posts from A,
and a send may block its stream until the receive is posted. ``plan_transfers`` therefore fixes, from
the schedule and the stage wiring alone (every rank computes the same plan), one global sequence of
computes and transfers; each rank issues its sends and posts its receives in that sequence's order
(each receive is posted before the action that consumes it, often earlier, and waited for only by its
consumer). So between any two ranks the sends and the receives come in the same order, and, with
receives posted exactly where the plan puts them (NCCL), the step completes even if every send and
receive blocked its pair's stream until its partner is posted. Tags stay (unique per message) for
gloo, where the interpreter may post receives earlier still.

Values between two stages of the SAME rank group (V-shaped schedules) pass through a local hand-off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS, Action
from autoshard.runtime.collective_watch import note

__all__ = ["Message", "Wiring", "ActionTransfers", "action_messages", "plan_transfers", "message_tag",
           "Transport"]

_KIND = {"act": 0, "grad": 1}


class Message(NamedTuple):
    """One tensor crossing stages for one microbatch. ``act``: value ``value`` going to its reader
    stage ``consumer``; ``grad``: the gradient of ``value`` coming back from reader ``consumer``."""
    kind: str
    value: int
    consumer: int
    microbatch: int


def message_tag(kind: str, value: int, consumer: int, microbatch: int, n_stages: int, n_micro: int) -> int:
    """A tag unique per (kind, value index, consumer stage, microbatch)."""
    return ((value * n_stages + consumer) * n_micro + microbatch) * 2 + _KIND[kind]


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

    def peer(self, my_index: int, other_stage: int) -> int:
        """Global rank of the ``my_index``-th rank of the group running ``other_stage``."""
        return self.ranks_of[self.group_of[other_stage]][my_index]

    def differentiable(self, v: int) -> bool:
        return self.meta[v][1].is_floating_point

    def tag(self, msg: Message) -> int:
        return message_tag(msg.kind, msg.value, msg.consumer, msg.microbatch, self.n_stages, self.microbatches)


def action_messages(a: Action, w: Wiring) -> tuple[list[tuple[Message, int]], list[tuple[Message, int]]]:
    """(what ``a`` consumes, what it produces), each a list of (message, the other stage), in the order
    the interpreter takes inputs and hands out outputs. F reads each received value and sends each
    output to every reader; B/BW read the gradient of each differentiable output from every reader and
    send each differentiable received value's gradient to its producer; W moves nothing."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        needs = [(Message("act", v, s, i), w.values[v][1]) for v in w.receives[s]]
        makes = [(Message("act", v, c, i), c) for v, consumers in w.sends[s] for c in consumers]
        return needs, makes
    if a.kind in ("B", "BW"):
        needs = [(Message("grad", v, c, i), c) for v, consumers in w.sends[s] if w.differentiable(v)
                 for c in consumers]
        makes = [(Message("grad", v, s, i), w.values[v][1]) for v in w.receives[s] if w.differentiable(v)]
        return needs, makes
    return [], []


@dataclass(frozen=True)
class ActionTransfers:
    """One compute action of a group with its cross-group traffic: ``posts`` (message, source group):
    receives to post before the action (for this or a later action); ``sends`` (message, destination
    group): what the action produced for other groups, sent right after it."""
    action: Action
    posts: tuple
    sends: tuple


def plan_transfers(compute: dict[int, list[Action]], w: Wiring) -> dict[int, list[ActionTransfers]]:
    """Per rank group, its compute actions with the receives to post before each and the sends after.

    ``compute``: group -> its compute actions in execution order (``executed_schedule``). One global
    sequence of computes and transfers is built by running the groups in lockstep rounds (every group
    whose next action has its inputs runs it, lowest group first; each remote output is transferred
    right after its producer); each group's plan is that sequence seen from the group. So between any
    two groups the sender's sends and the receiver's receives come in the same order, and even if every
    send and receive blocked until its partner is posted (NCCL rendezvous, one stream per pair), running
    the global sequence in order completes. Raises ``RuntimeError`` naming the actions if the groups
    cannot all finish (a consumer without its producer) or a message is produced but never consumed."""
    for h, acts in compute.items():
        for a in acts:
            if a.kind not in COMPUTE_KINDS:
                raise RuntimeError(f"plan_transfers takes compute actions only; got {a}")
            if w.group_of[a.stage] != h:
                raise RuntimeError(f"action {a} names stage {a.stage}, which rank group {h} does not run (the wiring "
                                   f"puts it on group {w.group_of[a.stage]})")
    order = sorted(compute)
    pc = dict.fromkeys(order, 0)
    have: dict[int, set] = {g: set() for g in order}
    inbox: dict[int, list] = {g: [] for g in order}
    posts: dict[int, list] = {g: [] for g in order}
    sends: dict[int, list] = {g: [] for g in order}
    while any(pc[g] < len(compute[g]) for g in order):
        ready = [g for g in order if pc[g] < len(compute[g])
                 and all(m in have[g] for m, _ in action_messages(compute[g][pc[g]], w)[0])]
        if not ready:
            stuck = {g: str(compute[g][pc[g]]) for g in order if pc[g] < len(compute[g])}
            raise RuntimeError(f"the rank groups' actions cannot all run: stuck at {stuck}, each waiting for a value "
                               "no earlier action produces (the schedule is missing or misorders an action)")
        for g in ready:
            a = compute[g][pc[g]]
            posts[g].append(tuple(inbox[g]))
            inbox[g] = []
            out = []
            for m, dst in action_messages(a, w)[1]:
                h = w.group_of[dst]
                if h not in have:
                    raise RuntimeError(f"group {g} produces {m} in {a} for stage {dst}, whose group {h} has no action list")
                have[h].add(m)
                if h != g:
                    out.append((m, h))
                    inbox[h].append((m, g))
            sends[g].append(tuple(out))
            pc[g] += 1
    for g in order:
        needed = {m for a in compute[g] for m, src in action_messages(a, w)[0] if w.group_of[src] != g}
        extra = [m for step in posts[g] for m, _ in step if m not in needed] + [m for m, _ in inbox[g]]
        if extra:
            raise RuntimeError(f"group {g} is sent {extra[0]}, which none of its actions consumes (the schedule is "
                               "missing an action)")
    return {g: [ActionTransfers(a, p, s) for a, p, s in zip(compute[g], posts[g], sends[g])] for g in order}


@dataclass(eq=False)
class Transport:
    """This rank's point-to-point traffic for one step: receives posted (possibly ahead of use), sends
    in flight, and local hand-offs between stages of the same group."""
    device: torch.device
    local: dict = field(default_factory=dict)
    posted: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)
    sources: dict = field(default_factory=dict)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        t = tensor.detach().contiguous()
        note(f"send (tag {tag})", f"to rank {dst}")
        self.pending.append((dist.isend(t, dst, tag=tag), t))

    def post_recv(self, key, shape, dtype, src: int, tag: int) -> None:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.posted[key] = (dist.irecv(buf, src, tag=tag), buf)
        self.sources[key] = src

    def recv(self, key) -> torch.Tensor:
        work, buf = self.posted.pop(key)
        note(f"recv of {key}", f"from rank {self.sources.get(key, '?')}")
        work.wait()
        return buf

    def put(self, key, tensor: torch.Tensor) -> None:
        self.local[key] = tensor.detach()

    def take(self, key) -> torch.Tensor:
        if key not in self.local:
            raise RuntimeError(f"pipeline hand-off {key} was taken before it was produced: the schedule runs a "
                               "consumer before its producer on the same rank group")
        return self.local.pop(key)

    def drain(self) -> None:
        """Wait for every send (each tensor stays referenced until its send completes)."""
        note(f"waiting for {len(self.pending)} sends to complete")
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
