"""Run the steps that take a tensor placed one way to the same tensor placed another way.

The steps themselves (which collective on which mesh axis, in which order) are
``passes.layout.redistribution.plan_redistribute``, which the cost model prices too;
``step_call`` gives the collective function of a step, ``redistribute`` runs them eagerly, and the
lowering pass emits the same steps as calls in the per-rank program.

>>> plan_redistribute((S(0), S(0)), (R, S(0)), (2, 2))
[Step('all_gather', 1, 0), Step('all_gather', 0, 0), Step('chunk', 1, 0)]
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from autoshard.passes.layout.redistribution import Step, plan_redistribute
from autoshard.passes.spec import Placement

from . import collectives as C

__all__ = ["Step", "plan_redistribute", "step_call", "redistribute"]


def step_call(step: Step) -> tuple[Callable, tuple]:
    """The collective function and its static arguments (the comm is appended by the caller)."""
    fn = C.COLLECTIVES[step.kind]
    if step.kind in ("all_gather", "reduce_scatter", "chunk"):
        return fn, (step.dim,)
    if step.kind == "all_to_all":
        return fn, (step.dim, step.dim2)
    return fn, ()


def redistribute(x: torch.Tensor, src: Sequence[Placement], dst: Sequence[Placement], env) -> torch.Tensor:
    """Run the steps eagerly (autograd-aware). ``env``: a ``MeshEnv``."""
    for step in plan_redistribute(src, dst, env.mesh.shape, x.dim()):
        fn, args = step_call(step)
        x = fn(x, *args, env.comm(step.axis))
    return x
