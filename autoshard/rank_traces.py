"""Every rank of ``compile`` runs rank 0's program, whatever order its own trace came out in.

Rank 0 plans on its own trace and sends the plan; every rank then traces the model itself and binds
the plan to its trace by node names. A model whose Python visits independent computations in an
order set by the process (ModernBERT loops over ``set(config.layer_types)``, and every process torchrun
starts has its own string hash seed) traces into the same ops in another order under other names on
another rank, so the ranks of one stage would place different computations and wait in different
collectives. (Under torch's "fake" backend, whose collectives move nothing, traces are kept as they
are.) ``same_program_as_rank0(env)`` is the hook ``driver.trace`` applies on every rank once
planning is done: rank 0 sends ``passes.capture.align.structural_keys`` of its trace, each rank
rebuilds its own in rank 0's order under rank 0's names (``align``), and every rank learns whether
every other one could: a trace that is a different program raises ``TraceMismatchError`` on every
rank (naming the op on the ranks where it differs) rather than leaving the others to wait.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autoshard.passes.capture.align import align, structural_keys
from autoshard.passes.errors import TraceMismatchError
from autoshard.passes.graph import CapturedGraph
from autoshard.runtime.groups import run_and_broadcast

__all__ = ["same_program_as_rank0"]


def same_program_as_rank0(env: Any) -> Callable[[CapturedGraph], CapturedGraph]:
    """``captured -> captured`` in rank 0's order and names; a collective: every rank calls it for the
    same traces in the same order. The identity without a process group."""

    def agree(captured: CapturedGraph) -> CapturedGraph:
        if env is None or not getattr(env, "distributed", False):
            return captured
        if dist.get_backend() == "fake":  # torch's fake process group moves no data: there is no peer to agree with
            return captured
        reference = run_and_broadcast(lambda: structural_keys(captured), env=env)
        failure = None
        try:
            aligned = align(captured, reference)
        except TraceMismatchError as e:
            failure, aligned = e, captured
        failed = torch.tensor([env.rank if failure is not None else -1], dtype=torch.int64, device=env.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if int(failed.item()) >= 0:
            raise TraceMismatchError(
                f"rank {int(failed.item())} traced the model into another program than rank 0 (its error names "
                "the op): the model's forward depends on the process; make it trace the same on every rank")
        return aligned

    return agree
