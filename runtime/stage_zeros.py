"""The ZeRO parameters of a rank's stages: one ``zero.ZeroSync`` per stage, and how a step drives them.

``StageZeros.of(program)`` builds, for each of this rank's stages (``stage.LoweredStage``) with
parameters in a ZeRO form (``zero1`` / ``zero2``), a ``ZeroSync`` over the stage's (sub)mesh. The
executor (``runtime.executor``) then:

- calls ``begin_step`` before a step (the parameters the optimizer changed gathered once);
- hands ``around`` and ``ready`` to the interpreter: each stage's ZeroSync is armed before and
  finished after every weight action (BW, or a zero-bubble W whose gradients ``ready`` buckets), its
  ``last`` the stage's last weight action of the step, where ``zero1`` buckets reduce;
- sums a weight held by several stages (tied embeddings) over its holders' slices (``tied_sum``):
  every holder stores it alike (checked when built), so the k-th ranks of the holding groups step
  the same slice, and a gradient carried from before the step is counted once.

A pipeline refuses ``once`` (FSDP copies' gradients held over the whole step): the gatherer holds
them per round of accumulation, not per microbatch of a pipeline, yet.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.sharding.storage_forms import ZERO1, ZERO2, fmt_storage, holds_copies

from .zero import ZeroSync, zero_sync_for

__all__ = ["StageZeros"]


class StageZeros:
    """Stage index -> its ``ZeroSync`` on this rank (only stages with ZeRO parameters)."""

    def __init__(self, syncs: dict[int, ZeroSync]):
        self.syncs = syncs

    @classmethod
    def of(cls, plan, captured, stages: dict, strategies: dict, env, holders: dict, bucket_bytes: int) -> "StageZeros":
        """The ZeroSyncs of ``stages`` (this rank's ``LoweredStage``s; ``strategies``: stage -> its
        strategies) over ``env``'s mesh; ``holders``: parameter -> (stages holding it, groups), for the
        check that a weight several stages hold is stored alike by each."""
        syncs = {}
        for s, stage in stages.items():
            if plan.pipelined:
                _refuse_held_copies(s, stage, strategies[s], captured)
            mp = stage.levers.mixed_precision
            z = zero_sync_for(stage.graph.captured, strategies[s], env.mesh.shape,
                              dict(zip(stage.param_names, stage.params)), env.comm_for,
                              reduce_dtype=None if mp is None else (mp.reduce_dtype or mp.param_dtype),
                              bucket_bytes=bucket_bytes)
            if z is not None:
                syncs[s] = z
        _check_ties(plan, captured, holders)
        return cls(syncs)

    def __bool__(self) -> bool:
        return bool(self.syncs)

    def get(self, s: int) -> Optional[ZeroSync]:
        return self.syncs.get(s)

    # ---- a step ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        for z in self.syncs.values():
            z.begin_step()

    def around(self, s: int, after: bool, last: bool) -> None:
        """Around one weight action of stage ``s``: armed before, finished after (``last``: the step's
        last, where ``zero1`` buckets reduce and the slices' gradients are set)."""
        z = self.syncs.get(s)
        if z is None:
            return
        if after:
            z.finish(last)
        else:
            z.arm(last)

    def ready(self, s: int, p, sync: Optional[Callable]) -> None:
        """A zero-bubble W set ``p``'s gradient: bucket it (ZeRO), then hand it to ``sync(s, p)`` (the
        grad sync's hook in the step's last round) if it is still there."""
        z = self.syncs.get(s)
        if z is not None:
            z.ready(p)
        if sync is not None and p.grad is not None:
            sync(s, p)

    def tied_sum(self, mine: list, ph: str, group) -> bool:
        """Sum the gradient of weight ``ph`` over its holders when they hold it in a ZeRO form (``mine``:
        this rank's holding stages; ``group``: the process group joining the holding rank groups' k-th
        ranks, or None). False (nothing done) when it is not in a ZeRO form here."""
        zeros = [self.syncs.get(st.index) for st in mine]
        if not zeros or any(z is None for z in zeros):
            return False
        shards = [z.shards.get(st.params[st.param_names.index(ph)]) for z, st in zip(zeros, mine)]
        if any(sh is None for sh in shards):
            return False
        total = torch.zeros_like(shards[0])
        for z, sh in zip(zeros, shards):
            if sh.grad is not None:
                total += sh.grad - z.carried[sh] if sh in z.carried else sh.grad
        if group is not None:
            dist.all_reduce(total, group=group)
        for z, sh in zip(zeros, shards):
            if sh.requires_grad:
                sh.grad = total + z.carried[sh] if sh in z.carried else total.clone()
        return True

    # ---- state -------------------------------------------------------------------------------------
    def optimizer_parameter(self, param):
        """What the optimizer steps in place of ``param``: its ZeRO slice, or ``param`` itself."""
        for z in self.syncs.values():
            if param in z.shards:
                return z.shards[param]
        return param

    def gather(self) -> None:
        for s in sorted(self.syncs):
            self.syncs[s].gather()

    def calls(self) -> dict[str, int]:
        """The collectives called so far, by kind, over the stages."""
        total: dict[str, int] = {}
        for z in self.syncs.values():
            for kind, n in z.calls.items():
                total[kind] = total.get(kind, 0) + n
        return total


def _refuse_held_copies(index: int, stage, strategies: dict, captured) -> None:
    for ph in stage.param_names:
        st = strategies.get(ph)
        if st is not None and st.lowerings and holds_copies(st):
            raise PlanFormatError(f"stage {index} stores parameter {captured.params.get(ph, ph)} as "
                                  f"{fmt_storage(st.outputs[0], st.lowerings)}: the reduce-once form (/once) runs "
                                  "only without a pipeline yet; pin S(d) without /once (zero1/zero2 forms do run "
                                  "under a pipeline)")


def _check_ties(plan, captured, holders: dict) -> None:
    """A weight shared by stages in a ZeRO form must be stored alike by every holder, on alike submeshes."""
    for ph, (stages, _) in holders.items():
        forms = {(tuple(plan.stages[s].solution.strategies[ph].outputs[0]),
                  tuple(plan.stages[s].solution.strategies[ph].lowerings or ()),
                  tuple(plan.stages[s].mesh.shape)) for s in stages}
        if any(f in (ZERO1, ZERO2) for _, lw, _ in forms for f in lw) and len(forms) > 1:
            raise PlanFormatError(f"parameter {captured.params.get(ph, ph)} is held by stages {stages} in different "
                                  f"storage ({sorted(forms, key=str)}); a weight shared by stages in a ZeRO form must be "
                                  "stored alike by every holder on alike submeshes: pin it the same way")
