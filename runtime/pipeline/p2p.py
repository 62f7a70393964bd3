"""Point-to-point transfers between pipeline stages (gloo on CPU, NCCL on GPU, over the world group).

Boundary layout: a value crossing stages travels REPLICATED. The sending stage's program gathers each
output to ``R`` inside its rank group (the core lowering's rule for program outputs), and the k-th
rank of the sending group sends its full copy to the k-th rank of the receiving group (groups have
equal sizes: they split the mesh's first axis). The receiver feeds the full value to its program as
an entry input, which chunks it to whatever placement its plan wants, for free. Gradients go back on
the same pairs: under the gradient convention the receiver's local gradient of an ``R`` value is a
summand (the group's local gradients sum to the true one), and so is what the sender needs, since
the gather that made the output ``R`` reduces summands in its backward. Costlier on the wire than a
batch-sharded ``S(0)`` boundary, but correct for every pair of intra-stage plans.

Values between two stages of the SAME rank group (V-shaped schedules) pass through a local mailbox.
Every message has its own tag, so arrival order does not matter (gloo matches on tags).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Mailbox", "message_tag"]

_KIND = {"act": 0, "grad": 1}


def message_tag(kind: str, value: int, consumer: int, microbatch: int, n_stages: int, n_micro: int) -> int:
    """A tag unique per (kind, value index, consumer stage, microbatch)."""
    return ((value * n_stages + consumer) * n_micro + microbatch) * 2 + _KIND[kind]


@dataclass(eq=False)
class Mailbox:
    """This rank's sends in flight and local hand-offs for one step."""
    local: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        t = tensor.detach().contiguous()
        self.pending.append((dist.isend(t, dst, tag=tag), t))

    def recv(self, shape, dtype, device, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buf, src, tag=tag).wait()
        return buf

    def put(self, key, tensor: torch.Tensor) -> None:
        self.local[key] = tensor.detach()

    def take(self, key) -> torch.Tensor:
        if key not in self.local:
            raise RuntimeError(f"pipeline hand-off {key} was taken before it was produced: the schedule runs a "
                               "consumer before its producer on the same rank group")
        return self.local.pop(key)

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
