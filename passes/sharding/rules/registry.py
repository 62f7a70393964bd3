"""One registry of sharding rules keyed by ATen op.

A rule receives an ``OpCall`` (the op's arguments with every tensor replaced by its
``TensorMeta``) and returns the ``Strategy1D`` options valid along ONE mesh axis of any size.
Divisibility by the actual axis sizes is checked later (passes/sharding/strategies.py); a rule only states
which dims may be split. The all-replicated strategy is always added by ``rule_strategies`` so a
rule never has to list it.

    @register_rule(aten.mm.default)
    def mm(call: OpCall) -> list[Strategy1D]: ...

Ops with no rule run replicated (always correct); ``rule_strategies`` reports them so the plan
can list them by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.fx as fx

from autoshard.passes.graph import META, is_getitem, operand_meta, operands, outputs
from autoshard.passes.spec import Replicate, Strategy1D, TensorMeta

RuleFn = Callable[["OpCall"], list[Strategy1D]]
RULES: dict[Any, RuleFn] = {}


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


def register_rule(*targets) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the rule for each ATen overload (or packet: all its overloads) given."""
    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            if t in RULES:
                raise ValueError(f"two sharding rules registered for {t}")
            RULES[t] = fn
        return fn
    return deco


def _lookup(target) -> Optional[RuleFn]:
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    return RULES.get(packet) if packet is not None else None


def op_call(node: fx.Node) -> OpCall:
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
    if is_getitem(node):
        from autoshard.passes.sharding.rules.getitem import getitem_rule  # noqa: WPS433 (rule module imported lazily on purpose)
        found = getitem_rule(call)
        has_rule = True
    else:
        _ensure_loaded()
        fn = _lookup(node.target)
        has_rule = fn is not None
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
    return out, has_rule


_loaded = False


def _ensure_loaded() -> None:
    """Import every rule module once so their decorators fill RULES."""
    global _loaded
    if not _loaded:
        _loaded = True
        from autoshard.passes.sharding.rules import ALL_RULE_MODULES  # noqa: F401
