"""One registry of sharding rules keyed by op (an ATen overload or packet, ``operator.getitem``, or an
op's qualified name such as ``"transformers::grouped_mm_fallback"``).

A rule receives an ``OpCall`` (the op's arguments with every tensor replaced by its
``TensorMeta``) and returns the ``Strategy1D`` options valid along ONE mesh axis of any size.
Divisibility by the actual axis sizes is checked later (passes/sharding/strategies.py); a rule only states
which dims may be split. The all-replicated strategy is always added by ``rule_strategies`` so a
rule never has to list it.

    @register_rule(aten.mm.default)
    def mm(call: OpCall) -> list[Strategy1D]: ...

A qualified name (``"ns::op"`` for every overload, ``"ns::op.overload"`` for one) keys a rule for an
op whose library may not be imported yet (a framework's ``torch.library`` custom op).

This module only holds the table; importing the package ``passes.sharding.rules`` imports every
family module, whose decorators fill it. Ops with no rule run replicated (always correct);
``rule_strategies`` reports them so the plan can list them by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, wraps
from typing import Any, Callable, Optional

import torch.fx as fx

from autoshard.passes.graph import META, operand_meta, operands, outputs
from autoshard.passes.op_facts import OpFacts, find_registered, qualified_names, register_facts
from autoshard.passes.schema import bind_args, op_name
from autoshard.passes.spec import Partial, Replicate, Strategy1D, TensorMeta

__all__ = ["OpCall", "RuleFn", "LocalCheck", "RULES", "LOCAL_CHECKS", "register_rule", "lookup", "local_check",
           "qualified_names", "op_call", "rule_strategies"]

RuleFn = Callable[["OpCall"], list[Strategy1D]]
RULES: dict[Any, RuleFn] = {}
#: ``check(call, local_input_shapes, local_output_shapes) -> bool``: whether the op runs on pieces of
#: these shapes (a kernel's constraint the rule cannot state per axis, e.g. stride alignment).
LocalCheck = Callable[["OpCall", list, list], bool]
LOCAL_CHECKS: dict[Any, LocalCheck] = {}


@dataclass(frozen=True)
class OpCall:
    """An op application as a rule sees it.

    ``args``/``kwargs``: the node's arguments with each tensor-valued fx Node replaced by its
    ``TensorMeta`` (other values as traced). ``inputs``: TensorMeta of each tensor operand, in
    ``passes.graph.operands`` order. ``outputs``: TensorMeta of each tensor output.
    """
    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    @cached_property
    def bound_args(self) -> dict[str, Any]:
        """Every argument by schema name, defaults filled in (``passes.schema.bind_args``):
        ``{"self": TensorMeta, "dim": [1], "keepdim": False, "dtype": None}``."""
        return bind_args(self.target, self.args, self.kwargs)

    @property
    def op_name(self) -> str:
        """The schema name without namespace or overload (``"add_"`` for ``aten.add_.Tensor``)."""
        return op_name(self.target)

    def operand_names(self) -> list[str]:
        """Schema name of each tensor operand, in ``inputs`` order (a list argument repeats its name)."""
        schema = self.target._schema.arguments
        names: list[str] = []

        def visit(name: str, value: Any) -> None:
            if isinstance(value, TensorMeta):
                names.append(name)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    visit(name, v)

        for i, value in enumerate(self.args):
            visit(schema[i].name, value)
        for name, value in self.kwargs.items():
            visit(name, value)
        if len(names) != len(self.inputs):
            raise AssertionError(f"{self.target}: found {len(names)} tensor operands, OpCall has {len(self.inputs)}")
        return names


def floating_partials(call: OpCall, strategy: Strategy1D) -> bool:
    """Whether every ``P`` of ``strategy`` sits on a floating tensor (no integer or boolean summands:
    casts and comparisons of summands are not those of the sum, and only floats carry gradients)."""
    pairs = list(zip(call.inputs, strategy.inputs)) + list(zip(call.outputs, strategy.outputs))
    return all(m.dtype.is_floating_point or m.dtype.is_complex for m, p in pairs if isinstance(p, Partial))


def register_rule(*targets, float_partials_only: bool = False, local_check: Optional[LocalCheck] = None,
                  facts: Optional[OpFacts] = None) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for each op given (an overload, a packet: all its overloads, or a qualified name).

    ``float_partials_only``: drop the strategies that put ``P`` on a non-floating tensor, so the
    rule may list ``P`` options without checking dtypes. ``local_check``: a ``LocalCheck`` the
    enumeration applies to each mesh strategy's local shapes (after divisibility). ``facts``: the
    ops' ``OpFacts`` (``passes/op_facts.py``: compute-bound FLOPs, GEMM shape, saved tensors), recorded
    for every target. Returns the rule as registered.
    """
    def deco(fn: RuleFn) -> RuleFn:
        rule = _without_non_float_partials(fn) if float_partials_only else fn
        for t in targets:
            if t in RULES:
                raise ValueError(f"two sharding rules registered for {t}")
            RULES[t] = rule
            if local_check is not None:
                LOCAL_CHECKS[t] = local_check
        if facts is not None:
            register_facts(*targets, facts=facts)
        return rule
    return deco


def _without_non_float_partials(fn: RuleFn) -> RuleFn:
    @wraps(fn)
    def rule(call: OpCall) -> list[Strategy1D]:
        return [s for s in fn(call) if floating_partials(call, s)]
    return rule


def lookup(target) -> Optional[RuleFn]:
    """The rule for ``target``: registered for the overload itself, else for its packet, else under its
    qualified name (overload, then op); or None."""
    return find_registered(RULES, target)


def local_check(target) -> Optional[LocalCheck]:
    """The ``LocalCheck`` registered with ``target``'s rule (found as ``lookup`` finds it), or None."""
    return find_registered(LOCAL_CHECKS, target) if LOCAL_CHECKS else None


def op_call(node: fx.Node) -> OpCall:
    """The ``OpCall`` a rule sees for a call_function node (its operands must carry META)."""
    def sub(a):
        if isinstance(a, fx.Node):
            m = a.meta.get(META)
            return m if isinstance(m, TensorMeta) else a
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        if isinstance(a, dict):
            return {k: sub(v) for k, v in a.items()}
        return a

    return OpCall(
        target=node.target,
        args=sub(node.args),
        kwargs=sub(dict(node.kwargs)),
        inputs=tuple(operand_meta(o) for o in operands(node)),
        outputs=tuple(m for m in outputs(node) if m is not None),
    )


def rule_strategies(node: fx.Node) -> tuple[list[Strategy1D], bool]:
    """1-D strategies for a call_function node, and whether a rule covered it.

    The all-replicated strategy comes first and is always present.
    """
    call = op_call(node)
    replicated = Strategy1D(tuple(Replicate() for _ in call.inputs), tuple(Replicate() for _ in call.outputs))
    fn = lookup(node.target)
    found = fn(call) if fn is not None else []
    out = [replicated]
    for s in found:
        if len(s.inputs) != len(call.inputs) or len(s.outputs) != len(call.outputs):
            raise AssertionError(
                f"rule for {node.target} returned {s} for an op with {len(call.inputs)} tensor inputs and "
                f"{len(call.outputs)} outputs"
            )
        if s not in out:
            out.append(s)
    return out, fn is not None
