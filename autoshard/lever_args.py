"""The memory-lever arguments of ``autoshard.plan`` / ``compile``: checked, resolved per block type,
turned into the planner's pins or applied to a plan's levers, and the microbatch they trace.

The levers themselves, their keywords and their value checks are one table,
``passes.levers.LEVERS``; this module applies them to a traced model.

- ``lever_pins(...)``: the keywords as ``LeverPins`` (None: the planner chooses);
- ``check_lever_values(...)``: refuse values of the wrong kind before anything is traced (the table's check);
- ``block_types(captured)`` and ``check_block_levers(captured, lever_args)``: per-block levers name
  the model's repeated-block types (or fnmatch patterns over them);
- ``pin_levers(captured, levers, ...)``: a plan's levers with the given ones applied;
- ``microbatch(example_inputs, example_target, k)``: what one of k accumulation microsteps sees;
- ``refuse_unrunnable_precision(plan)``: ``compile`` refuses levers only the planner prices.
"""
from __future__ import annotations

import fnmatch

import torch

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import LEVER_KEYWORDS, LEVERS, BlockPolicy, Levers, block_levers, block_type, check_lever
from autoshard.passes.pipeline.stages.retrace import block_types
from autoshard.passes.solve.lever_pins import LeverPins

__all__ = ["LEVER_KEYWORDS", "lever_pins", "check_lever_values", "block_types", "check_block_levers", "pin_levers",
           "microbatch", "refuse_unrunnable_precision"]


def lever_pins(**levers) -> LeverPins:
    """The memory-lever keywords of ``plan``/``compile`` (``passes.levers.LEVER_KEYWORDS``) as
    ``LeverPins`` (None or absent: the planner chooses; mixed precision is never chosen). Raises
    ``OptionError`` naming a bad value."""
    return LeverPins(**levers)


def check_block_levers(captured: CapturedGraph, lever_args: dict) -> None:
    """Block-type levers name this model's block types (``PlanFormatError`` otherwise)."""
    known = block_types(captured)
    for row in block_levers():
        if lever_args.get(row.keyword) is not None:
            _per_block(row.keyword, lever_args[row.keyword], known)


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


def pin_levers(captured: CapturedGraph, levers: Levers, **given) -> Levers:
    """``levers`` with the ``given`` lever keywords applied (None leaves a lever as ``levers`` has it):
    the one place ``compile``'s lever arguments enter a saved plan. A per-block lever takes one value for
    every block type of ``captured`` or a dict by block type."""
    check_lever_values(**given)
    blocks = dict(levers.blocks)
    known = block_types(captured)
    for row in block_levers():
        if given.get(row.keyword) is not None:
            for b, value in _per_block(row.keyword, given[row.keyword], known).items():
                blocks[b] = blocks.get(b, BlockPolicy()).replace(**{row.keyword: value})
    step = {row.keyword: given[row.keyword] if given.get(row.keyword) is not None else getattr(levers, row.keyword)
            for row in LEVERS if not row.per_block}
    return Levers(blocks=blocks, **step)


def check_lever_values(**levers) -> None:
    """Refuse lever arguments of the wrong kind (``passes.levers.check_lever``, the lever table's one
    check; block types are checked against a model by ``check_block_levers``/``pin_levers``)."""
    for keyword, value in levers.items():
        check_lever(keyword, value)


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


def refuse_unrunnable_precision(plan) -> None:
    """``compile`` runs a plan exactly as it was priced, or not at all: refuse a plan (any stage's levers)
    whose mixed precision accumulates gradients in its ``reduce_dtype`` (``MixedPrecision(...,
    accumulate_in_reduce_dtype=True)``, which ``layouts.megatron(accumulate_allreduce_grads_in_fp32=True)``
    prices): the runtime accumulates each parameter's gradient in the parameter's own dtype and casts it
    to ``reduce_dtype`` only for the reduction (``runtime.gradsync``), so it would not run what was priced."""
    solutions = [s.solution for s in plan.stages] if plan.pipelined else [plan.solution]
    for solution in solutions:
        mp = solution.levers.mixed_precision if solution is not None and solution.levers is not None else None
        if mp is not None and mp.accumulate_in_reduce_dtype:
            raise PlanFormatError(
                f"this plan accumulates gradients in {mp.reduce_dtype_name} and reduces them so ({mp!r}; a layout's "
                "accumulate_allreduce_grads_in_fp32=True), which autoshard.compile does not run: its runtime adds "
                "each microbatch's gradient in the parameter's own dtype. To train with gradients accumulated and "
                "reduced in float32, keep the model's parameters in float32 and plan with "
                "mixed_precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) "
                "(without layout=, or with a layout without accumulate_allreduce_grads_in_fp32); this plan prices "
                "the layout, it cannot be compiled")
