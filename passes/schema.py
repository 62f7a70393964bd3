"""Bind an ATen op call's arguments to its schema names, and back.

The one place that reads ``OpOverload._schema`` argument lists: sharding rules (through
``OpCall.bound_args``), the runtime's local rewrites and lowerings, and the rule-numerics harness
all bind a call here, so "which value is ``dim``" has one answer everywhere.

>>> bind_args(aten.sum.dim_IntList, (x, [1]), {})
{'self': x, 'dim': [1], 'keepdim': False, 'dtype': None}
>>> rebuild_args(aten.sum.dim_IntList, {'self': x, 'dim': [1], 'keepdim': True, 'dtype': None})
((x, [1], True), {'dtype': None})
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["schema_of", "op_name", "bind_args", "rebuild_args"]


def schema_of(target) -> Optional[torch.FunctionSchema]:
    """The ATen schema of ``target``, or None (``operator.getitem``, Python callables)."""
    return getattr(target, "_schema", None)


def op_name(target) -> str:
    """The op's schema name without namespace or overload: ``aten.add_.Tensor`` -> ``"add_"``."""
    return _require_schema(target).name.split("::")[-1]


def bind_args(target, args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
    """Every schema argument of ``target`` by name, in schema order, defaults filled in.

    Positional values bind to the non-keyword-only arguments in order, then ``kwargs`` by name,
    then each argument's schema default. Raises ``TypeError`` for an op without an ATen schema or
    a call that leaves an argument without a default unset (no valid call does).
    """
    schema = _require_schema(target)
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            raise TypeError(f"{target}: missing argument {arg.name!r}")
    return bound


def rebuild_args(target, bound: dict[str, Any]) -> tuple[tuple, dict]:
    """Inverse of ``bind_args``: positional arguments in schema order, keyword-only ones as kwargs."""
    args, kwargs = [], {}
    for arg in _require_schema(target).arguments:
        if arg.kwarg_only:
            kwargs[arg.name] = bound[arg.name]
        else:
            args.append(bound[arg.name])
    return tuple(args), kwargs


def _require_schema(target) -> torch.FunctionSchema:
    schema = schema_of(target)
    if schema is None:
        raise TypeError(f"{target} has no ATen schema")
    return schema
