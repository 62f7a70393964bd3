"""A pipeline schedule is data: ``Action(stage, kind, microbatch)`` per rank, in execution order.

Kinds: ``F`` forward; ``B`` backward for the stage's INPUT gradient only; ``W`` backward for the
stage's WEIGHT gradients only (zero-bubble schedules split backward into B and W); ``BW`` full
backward (input and weight grads together); ``SEND_F``/``RECV_F`` move an activation to/from the
next stage, ``SEND_B``/``RECV_B`` a gradient to/from the previous stage (``peer`` names the other
stage). Stages are numbered 0..S-1 over the whole pipeline (virtual stages included: with
interleaving, rank r owns several stages). A schedule is ``dict[rank, list[Action]]``.

>>> str(Action(2, "F", 0)), str(Action(1, "BW", 3)), str(Action(0, "SEND_F", 1, peer=1))
('2F0', '1BW3', '0SEND_F1->1')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KINDS = ("F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    microbatch: int
    peer: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; kinds are {KINDS}")

    def __str__(self) -> str:
        s = f"{self.stage}{self.kind}{self.microbatch}"
        return s + (f"->{self.peer}" if self.peer is not None and self.kind.startswith("SEND") else
                    f"<-{self.peer}" if self.peer is not None else "")

    def to_json(self) -> list:
        return [self.stage, self.kind, self.microbatch, self.peer]

    @classmethod
    def from_json(cls, data: list) -> "Action":
        stage, kind, mb, peer = data
        return cls(int(stage), str(kind), int(mb), None if peer is None else int(peer))


Schedule = dict  # dict[int (rank), list[Action]]
