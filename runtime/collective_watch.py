"""Every collective and point-to-point transfer of a step runs under a timeout, and a failed one is an
error naming the rank, the stage, the step's action and the op, never a silent hang.

Ranks that wait in different collectives (two ranks of a stage running different programs, a message
never sent) or a peer that died block a process group until its timeout: 30 minutes by default for
gloo. ``arm_timeout()`` (called when a rank's program is built, after the plan was agreed, so rank 0's
planning does not count) sets every process group of this process to ``step_timeout_s()`` seconds:
``AUTOSHARD_COLLECTIVE_TIMEOUT_S`` in the environment, else 600 s. Gloo then raises; NCCL (without
``TORCH_NCCL_BLOCKING_WAIT``) aborts the process from its watchdog, naming the op itself.

``note(op, group)`` records the op a rank is about to enter (the runtime's collectives and transfers
call it); ``watching(rank=, stage=, action=)`` around a piece of the step turns a communication failure
raised inside into ``CollectiveError`` naming where the rank was and the last op it entered.

>>> with watching(rank=3, stage=1, action="F1"):    # doctest: +SKIP
...     all_gather(x, 0, comm)                        # note("all_gather", comm) inside
CollectiveError: rank 3, stage 1, action F1: all_gather over 'dp' failed ...
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Iterator, Optional

import torch.distributed as dist

from autoshard.passes.errors import CollectiveError

__all__ = ["TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "step_timeout_s", "arm_timeout", "note", "watching"]

TIMEOUT_ENV = "AUTOSHARD_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0

_last: dict = {"op": None, "group": None}
# What a backend says when a peer is not there (gloo's timeouts and closed pairs; NCCL's blocking wait).
_COMMUNICATION_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "pair closure",
                           "broken pipe", "watchdog", "nccl")


def step_timeout_s() -> float:
    """Seconds a collective may wait: ``AUTOSHARD_COLLECTIVE_TIMEOUT_S``, else ``DEFAULT_TIMEOUT_S``."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give the seconds a collective may wait, a positive number")
    return seconds


def arm_timeout(seconds: Optional[float] = None) -> None:
    """Set every process group this process belongs to (the world and every subgroup made so far) to
    ``seconds`` (default ``step_timeout_s()``). A no-op without an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=step_timeout_s() if seconds is None else seconds)
    from torch.distributed import distributed_c10d as c10d
    groups = [c10d._get_default_group()] + [g for g in list(c10d._world.pg_map) if g is not c10d._get_default_group()]
    for group in groups:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        c10d._set_pg_timeout(timeout, group)


def _group_name(group: Any) -> str:
    name = getattr(group, "name", None)
    if isinstance(name, str):
        return repr(name)
    try:
        return f"ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # noqa: BLE001 - a name is only for the message
        return "the world" if group is None else repr(group)


def note(op: str, group: Any = None) -> None:
    """This rank enters ``op`` over ``group`` (an ``AxisComm``, a process group, or a peer's description)."""
    _last["op"], _last["group"] = op, group


def last_op() -> str:
    """The last op ``note``d, with its group, as words."""
    if _last["op"] is None:
        return "no collective recorded yet"
    group = _last["group"]
    where = "" if group is None else (f" {group}" if isinstance(group, str) else f" over {_group_name(group)}")
    return f"{_last['op']}{where}"


def is_communication_failure(error: BaseException) -> bool:
    if isinstance(error, CollectiveError) or not isinstance(error, RuntimeError):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _COMMUNICATION_FAILURES)


@contextlib.contextmanager
def watching(*, rank: Optional[int] = None, stage: Optional[int] = None, action: Optional[str] = None) -> Iterator[None]:
    """Run the block; a communication failure inside becomes ``CollectiveError`` naming ``rank`` (by
    default this process's rank in the world), ``stage``, ``action`` and the last op this rank entered
    (anything else passes through)."""
    try:
        yield
    except RuntimeError as e:
        if not is_communication_failure(e):
            raise
        if rank is None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        place = ", ".join(p for p in (None if rank is None else f"rank {rank}",
                                      None if stage is None else f"stage {stage}",
                                      None if action is None else f"action {action}") if p)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(
            f"{place or 'this rank'}: {last_op()} failed: {first_line[:300]}. The ranks of a group were waiting "
            f"in different collectives or transfers (they run different programs or orders), or a peer died or "
            f"is too slow ({TIMEOUT_ENV}={step_timeout_s():g} s): look at every rank's error, the first one "
            "names the op that diverged") from e
