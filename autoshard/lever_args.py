"""The memory-lever arguments of ``autoshard.plan`` / ``compile``: checked, resolved per block type,
turned into the planner's pins or applied to a plan's levers, and the microbatch they trace.

- ``lever_pins(...)``: the keywords as ``LeverPins`` (None: the planner chooses);
- ``check_lever_values(...)``: refuse values of the wrong kind before anything is traced;
- ``block_types(captured)`` and ``check_block_levers(captured, lever_args)``: per-block levers name
  the model's repeated-block types (or fnmatch patterns over them);
- ``pin_levers(captured, levers, ...)``: a plan's levers with the given ones applied;
- ``microbatch(example_inputs, example_target, k)``: what one of k accumulation microsteps sees.
"""
from __future__ import annotations

import fnmatch
from typing import Optional, Union

import torch

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import BlockPolicy, Levers, MixedPrecision, block_type
from autoshard.passes.solve.clustering import block_instance, module_path
from autoshard.passes.solve.lever_pins import LeverPins

__all__ = ["LEVER_KEYWORDS", "lever_pins", "check_lever_values", "block_types", "check_block_levers", "pin_levers",
           "microbatch"]

LEVER_KEYWORDS = ("accumulation", "checkpoint", "reshard_after_forward", "mixed_precision")


def lever_pins(accumulation=None, checkpoint=None, reshard_after_forward=None, mixed_precision=None) -> LeverPins:
    """The memory-lever keywords of ``plan``/``compile`` as ``LeverPins`` (None: the planner chooses;
    mixed precision is never chosen). Raises ``AutoshardError`` naming a bad value."""
    return LeverPins(accumulation, checkpoint, reshard_after_forward, mixed_precision)


def check_block_levers(captured: CapturedGraph, lever_args: dict) -> None:
    """Block-type levers name this model's block types (``PlanFormatError`` otherwise)."""
    known = block_types(captured)
    for name in ("checkpoint", "reshard_after_forward"):
        if lever_args.get(name) is not None:
            _per_block(name, lever_args[name], known)


def block_types(captured: CapturedGraph) -> list[str]:
    """The repeated-block types of a captured program ("layers.#"), in order of first op."""
    out: list[str] = []
    for node in captured.gm.graph.nodes:
        found = block_instance(module_path(node, captured)) if node.op == "call_function" else None
        if found and block_type(found[1]) not in out:
            out.append(block_type(found[1]))
    return out


def _per_block(name: str, value, known: list[str]) -> dict:
    """A lever given for every block type (a plain value) or by block type (a dict whose keys are block
    types or fnmatch patterns over them), as block type -> value."""
    if not known:
        raise PlanFormatError(f"{name}= applies to repeated blocks (numbered modules such as layers.0), and this "
                              "model has none")
    if not isinstance(value, dict):
        return dict.fromkeys(known, value)
    unknown = sorted(k for k in value if not any(t == k or fnmatch.fnmatchcase(t, str(k)) for t in known))
    if unknown:
        raise PlanFormatError(f"{name}= names block type(s) {unknown}; this model's block types are {known}")
    return {t: v for k, v in value.items() for t in known if t == k or fnmatch.fnmatchcase(t, str(k))}


def pin_levers(captured: CapturedGraph, levers: Levers, *, accumulation: Optional[int] = None,
               checkpoint: Union[None, str, dict] = None, reshard_after_forward: Union[None, bool, dict] = None,
               mixed_precision: Optional[MixedPrecision] = None) -> Levers:
    """``levers`` with the given pins applied (None leaves a lever as ``levers`` has it): the one place
    ``compile``'s lever arguments enter a plan. ``checkpoint``/``reshard_after_forward``: one value
    for every block type of ``captured`` or a dict by block type."""
    check_lever_values(accumulation, checkpoint, reshard_after_forward, mixed_precision)
    blocks = dict(levers.blocks)
    known = block_types(captured)
    if checkpoint is not None:
        for b, policy in _per_block("checkpoint", checkpoint, known).items():
            blocks[b] = BlockPolicy(policy, blocks.get(b, BlockPolicy()).reshard_after_forward)
    if reshard_after_forward is not None:
        for b, flag in _per_block("reshard_after_forward", reshard_after_forward, known).items():
            blocks[b] = BlockPolicy(blocks.get(b, BlockPolicy()).checkpoint, flag)
    return Levers(accumulation if accumulation is not None else levers.accumulation, blocks,
                  mixed_precision if mixed_precision is not None else levers.mixed_precision)


def check_lever_values(accumulation=None, checkpoint=None, reshard_after_forward=None, mixed_precision=None) -> None:
    """Refuse lever arguments of the wrong kind (block types are checked against a model by ``pin_levers``)."""
    if accumulation is not None and (isinstance(accumulation, bool) or not isinstance(accumulation, int)
                                     or accumulation < 1):
        raise TypeError(f"accumulation={accumulation!r}: pass an int >= 1 (the number of sequential microsteps)")
    for policy in (checkpoint.values() if isinstance(checkpoint, dict) else [checkpoint]):
        if policy is not None:
            BlockPolicy(policy)
    for flag in (reshard_after_forward.values() if isinstance(reshard_after_forward, dict) else [reshard_after_forward]):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"reshard_after_forward= takes True/False (or a dict of them by block type), got {flag!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision= takes autoshard.MixedPrecision(param_dtype=..., reduce_dtype=...), "
                        f"got {type(mixed_precision).__name__}")


def microbatch(example_inputs, example_target, k: int, keyword: str = "accumulation"):
    """The first ``1/k`` of every input tensor and of the target along dim 0 (what one of ``k``
    accumulation microsteps, or pipeline microbatches, sees); unchanged for k = 1. ``example_inputs``:
    a tuple/list or a dict of keyword inputs (non-tensors pass unchanged); ``keyword`` names the
    argument that asked for ``k`` in errors."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TypeError(f"{keyword}={k!r}: pass an int >= 1")
    if k == 1:
        return example_inputs, example_target

    def cut(name, x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] % k:
            raise BatchError(f"{name} has shape {tuple(x.shape)}: {keyword}={k} cuts dim 0 into {k} equal "
                             f"microbatches; use a global batch divisible by {k}")
        return x[: x.shape[0] // k]

    if isinstance(example_inputs, dict):
        inputs = {n: cut(f"input {n!r}", x) for n, x in example_inputs.items()}
    elif isinstance(example_inputs, (tuple, list)):
        inputs = type(example_inputs)(cut(f"input {i}", x) for i, x in enumerate(example_inputs))
    else:
        inputs = cut("the input", example_inputs)
    return inputs, None if example_target is None else cut("example_target", example_target)
