"""``register_sharding``: give your own op (a ``torch.library`` custom op, or any ATen op) a sharding rule.

An op without a rule runs replicated: every device computes all of it (``plan.replicated_ops``, the
plan summary and ``InfeasiblePlanError`` say what that costs). A rule says how the op may be split
along ONE mesh axis; the planner combines the options over the axes and prices them::

    @torch.library.custom_op("mylib::swiglu", mutates_args=())
    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    # plus torch.library.register_fake (capture needs it) and register_autograd (training needs it)

    @autoshard.register_sharding(torch.ops.mylib.swiglu.default)
    def swiglu_sharding(gate, up):                     # the op's arguments; tensors as TensorMeta
        return [([Shard(d), Shard(d)], [Shard(d)])     # (input placements, output placements)
                for d in range(gate.ndim)]

The function receives the op's arguments as traced, every tensor replaced by its ``TensorMeta``
(``.shape``, ``.ndim``, ``.dtype``), and returns the acceptable options, each either

- ``(input_placements, output_placements)``: one placement per tensor operand (in argument order),
  or one per schema argument with ``None`` for non-tensor arguments (DTensor's ``register_sharding``
  layout; note the order here: inputs first); and one per tensor output (a single placement for
  one output). Placements are DTensor's ``Shard(d)`` (negative ``d`` counts from the end),
  ``Replicate()``, ``Partial()`` (a sum), or their short forms ``"S(0)"``, ``"R"``, ``"P"``;
- or a ``Strategy1D`` (``autoshard.passes.spec``).

The all-replicated option is always added. Divisibility by the mesh is checked by the planner, so a
rule only says which dims may be split. ``P`` (each rank holds a summand) is dropped on integer and
boolean tensors. At run time each rank calls the op on its local pieces as they are: the rule must
be true of the op applied to pieces (a row-wise op shards rows, not the row).

``op`` may be an op overload (``torch.ops.mylib.swiglu.default``), its packet (every overload), a
qualified name (``"mylib::swiglu"``: the library need not be imported yet) or the object
``torch.library.custom_op`` returned. The rule joins the one registry the built-in rules live in
(``autoshard.passes.sharding.rules``); ``override=True`` replaces a rule registered for the same key.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from autoshard.passes.sharding.rules import LOCAL_CHECKS, RULES, OpCall, register_rule
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta, parse_placement

__all__ = ["register_sharding"]


def _keys(op) -> list:
    """The registry key(s) ``op`` names."""
    if isinstance(op, str):
        if "::" not in op:
            raise TypeError(f"register_sharding: a name must be qualified, 'namespace::op' or 'namespace::op.overload'; "
                            f"got {op!r}")
        return [op]
    inner = getattr(op, "_opoverload", None)  # what torch.library.custom_op returns
    if inner is not None:
        return [inner]
    if hasattr(op, "_schema") or hasattr(op, "overloads"):  # OpOverload / OpOverloadPacket
        return [op]
    raise TypeError(f"register_sharding takes an op overload (torch.ops.ns.op.default), its packet "
                    f"(torch.ops.ns.op), a 'ns::op' name or what torch.library.custom_op returned; "
                    f"got {type(op).__name__} {op!r}")


def _placement(p, meta: TensorMeta, where: str) -> Placement:
    if isinstance(p, str):
        p = parse_placement(p)
    if isinstance(p, Shard):
        ndim = len(meta.shape)
        if not -ndim <= p.dim < ndim:
            raise ValueError(f"{where}: Shard({p.dim}) on a {ndim}-d tensor")
        return Shard(p.dim % ndim)
    if isinstance(p, Partial):
        if getattr(p, "reduce_op", "sum") != "sum":
            raise ValueError(f"{where}: only Partial sums are supported, got {p}")
        return Partial()
    if isinstance(p, Replicate):
        return Replicate()
    raise TypeError(f"{where}: {p!r} is not a placement (Shard(d), Replicate(), Partial() or 'S(d)', 'R', 'P')")


def _operand_placements(call: OpCall, given: Sequence, label: str) -> tuple[Placement, ...]:
    """``given`` per tensor operand, or per schema argument (None for non-tensors), as operand placements."""
    given = list(given)
    if len(given) == len(call.inputs):
        return tuple(_placement(p, m, f"{label} operand {i}") for i, (p, m) in enumerate(zip(given, call.inputs)))
    schema = call.target._schema.arguments
    if len(given) == len(schema):
        out = []
        for arg, p in zip(schema, given):
            value = call.bound_args[arg.name]
            metas = [value] if isinstance(value, TensorMeta) else \
                [v for v in value if isinstance(v, TensorMeta)] if isinstance(value, (list, tuple)) else []
            if metas and p is None:
                raise ValueError(f"{label}: argument {arg.name!r} is a tensor but its placement is None")
            out += [_placement(p, m, f"{label} argument {arg.name!r}") for m in metas]
        if len(out) == len(call.inputs):
            return tuple(out)
    raise ValueError(f"{label}: {len(given)} input placements; the op has {len(call.inputs)} tensor operands "
                     f"(or give one per argument, {len(schema)}, with None for non-tensors)")


def _strategy(call: OpCall, option: Any, label: str) -> Strategy1D:
    if isinstance(option, Strategy1D):
        ins, outs = option.inputs, option.outputs
        if len(ins) != len(call.inputs) or len(outs) != len(call.outputs):
            raise ValueError(f"{label}: {option} has {len(ins)} inputs and {len(outs)} outputs; the op has "
                             f"{len(call.inputs)} tensor operands and {len(call.outputs)} tensor outputs")
        return option
    if not isinstance(option, (tuple, list)) or len(option) != 2:
        raise TypeError(f"{label}: each option is (input_placements, output_placements) or a Strategy1D, got {option!r}")
    ins, outs = option
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    if len(outs) != len(call.outputs):
        raise ValueError(f"{label}: {len(outs)} output placements; the op has {len(call.outputs)} tensor outputs")
    return Strategy1D(_operand_placements(call, ins, label),
                      tuple(_placement(p, m, f"{label} output {j}") for j, (p, m) in enumerate(zip(outs, call.outputs))))


def register_sharding(op, *, override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``fn(*op_args, **op_kwargs) -> [options]`` becomes the sharding rule of ``op`` (see the
    module docstring). Returns ``fn`` unchanged. ``ValueError`` when ``op`` already has a rule under the
    same key and ``override`` is False."""
    keys = _keys(op)

    def deco(fn: Callable) -> Callable:
        name = getattr(fn, "__qualname__", repr(fn))

        def rule(call: OpCall) -> list[Strategy1D]:
            options = fn(*call.args, **call.kwargs)
            if options is None:
                return []
            return [_strategy(call, o, f"sharding rule {name} for {call.target}, option {k}")
                    for k, o in enumerate(options)]

        rule.__name__ = rule.__qualname__ = f"user_rule_{getattr(fn, '__name__', 'fn')}"
        rule.__module__ = getattr(fn, "__module__", __name__)
        for key in keys:
            if key in RULES:
                if not override:
                    owner = getattr(RULES[key], "__module__", "?")
                    raise ValueError(f"{key} already has a sharding rule (from {owner}); pass override=True to "
                                     "replace it")
                del RULES[key]
                LOCAL_CHECKS.pop(key, None)
        register_rule(*keys, float_partials_only=True)(rule)
        return fn

    return deco
