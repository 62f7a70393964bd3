"""Activation recomputation: run a piece of the program so that backward re-runs it instead of
keeping what autograd would save.

``checkpointed(fn, args, policy=...)`` is the one way the plain path recomputes (a checkpointed
block region, ``regions``), built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``:

- "full": autograd keeps only ``args``; the first backward use of anything inside re-runs ``fn``;
- "selective": the outputs of matmuls and attention (the kernels whose ``OpFacts.selective_save`` is
  set with their sharding rule, the list the cost model prices) are kept, everything else
  (cheap pointwise ops, norms, and the collectives, which are re-issued) is recomputed
  (``create_selective_checkpoint_contexts``). The c10d ops are never saved: they write into a
  buffer in place, so a cached result would hand back the buffer unreduced.
- "selective_op": torchtitan's op-level policy (``passes.capture.saved.op_policy_saves``, which the
  cost model prices too): the SDPA kernels' outputs and every other ``aten.mm`` output (the 1st, 3rd,
  ... of the region, counted apart in the forward and in the recomputation) are kept, the rest
  recomputed.

``Replay`` makes a forward function re-runnable as its first run was; both this path and the
pipeline stage's recomputation (``pipeline.stage``) use it:

- the re-run draws the same random numbers (dropout masks match): the RNG state of the first run
  is restored inside ``torch.random.fork_rng``, so the caller's RNG stream is left as it was;
- arguments the function writes in place (``writable``: buffers such as BatchNorm's running
  statistics) are copied before the first run and the re-run gets fresh copies of those copies, so
  it reads the values the first run read and its writes are dropped (statistics updated once);
- during a re-run ``rerunning()`` is True (parameter gathers then prefetch for backward).
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard.passes.capture.saved import OP_POLICY_COUNTED, is_selective_save_op, op_policy_saves
import autoshard.passes.sharding.rules  # noqa: F401  (registers the op facts is_selective_save_op reads)

__all__ = ["checkpointed", "Replay", "rerunning", "outside_selective_checkpoint", "rng_state", "restore_rng",
           "POLICIES"]

POLICIES = ("full", "selective", "selective_op")
_RERUN = contextvars.ContextVar("autoshard_rerun", default=False)
_SELECTIVE_MODES: "weakref.WeakSet" = weakref.WeakSet()  # the dispatch modes our selective regions run under

def rerunning() -> bool:
    """Whether the code running now is a ``Replay`` re-run (a recomputation during backward)."""
    return _RERUN.get()


def rng_state(tensors: Sequence) -> tuple:
    """(CPU RNG state, the CUDA devices ``tensors`` live on, their RNG states)."""
    devices = sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def restore_rng(state: tuple) -> None:
    cpu, devices, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)


class Replay:
    """``fn`` made re-runnable as its first run (see the module docstring). Call it like ``fn``: the
    first call runs it and records what the re-runs need; every later call is a re-run."""

    def __init__(self, fn: Callable, writable: Sequence[int] = ()):
        self.fn, self.writable = fn, tuple(writable)
        self.runs = 0
        self._rng = None
        self._snapshots: dict[int, torch.Tensor] = {}

    def __call__(self, *args):
        self.runs += 1
        if self.runs == 1:
            self._rng = rng_state(args)
            self._snapshots = {i: args[i].detach().clone() for i in self.writable}
            return self.fn(*args)
        args = list(args)
        for i, snap in self._snapshots.items():
            args[i] = snap.clone()
        token = _RERUN.set(True)
        try:
            with torch.random.fork_rng(devices=self._rng[1]):
                restore_rng(self._rng)
                return self.fn(*args)
        finally:
            _RERUN.reset(token)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_selective_save_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    caching, cached = create_selective_checkpoint_contexts(_keep_matmuls)
    _SELECTIVE_MODES.add(caching)
    _SELECTIVE_MODES.add(cached)
    return caching, cached


def _op_level_contexts():
    """torchtitan's op-level policy for one region: a fresh ``aten.mm`` count per pass (forward,
    recomputation), so both passes make the same decision for the same call."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = op.overloadpacket.__name__
        if name == OP_POLICY_COUNTED:
            counts[ctx.is_recompute] += 1
        saves = op_policy_saves(name, counts[ctx.is_recompute])
        return CheckpointPolicy.MUST_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE

    caching, cached = create_selective_checkpoint_contexts(policy)
    _SELECTIVE_MODES.add(caching)
    _SELECTIVE_MODES.add(cached)
    return caching, cached


@contextlib.contextmanager
def outside_selective_checkpoint():
    """Run the body unseen by the selective checkpointing of the region it is in (other dispatch modes,
    such as a memory tracker around the step, still see it). Selective checkpointing replays a
    region's ops by position; work whose ops differ between the forward and the re-run (parameter
    gathers: which prefetch they consume and start) must stay out of its count."""
    popped = []
    while (mode := _get_current_dispatch_mode()) is not None and mode in _SELECTIVE_MODES:
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def checkpointed(fn: Callable, args: Sequence, *, policy: str, writable: Sequence[int] = ()):
    """``fn(*args)``, its activations recomputed in backward under ``policy`` (``POLICIES``);
    ``writable``: positions of ``args`` that ``fn`` writes in place (see ``Replay``)."""
    if policy not in POLICIES:
        raise ValueError(f"checkpoint policy {policy!r}: choose one of {list(POLICIES)}")
    kwargs = {}
    if policy == "selective":
        kwargs["context_fn"] = _selective_contexts
    elif policy == "selective_op":
        kwargs["context_fn"] = _op_level_contexts
    replay = Replay(fn, writable)
    # Written arguments reach the function by closure, not through checkpoint, which would keep them
    # and refuse to recompute once they are modified; the re-run reads Replay's copies instead.
    written = {i: args[i] for i in replay.writable}
    rest = [a for i, a in enumerate(args) if i not in written]

    def run(*given):
        it = iter(given)
        return replay(*[written[i] if i in written else next(it) for i in range(len(args))])

    return checkpoint(run, *rest, use_reentrant=False, preserve_rng_state=False, **kwargs)
