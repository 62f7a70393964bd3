"""What the compiler knows of an op besides its sharding rule: how its work is priced and what autograd
keeps of it. One table, ``OP_FACTS``, keyed as the rules are (an ``OpOverload``, its packet for every
overload, or a qualified name ``"ns::op"``), filled beside each rule: ``register_rule(..., facts=...)``
or ``register_facts(op, facts=...)`` in the rule's family module (``passes/sharding/rules/``).

Readers: the cost model (``passes/cost/facts.py``: an op with ``flops`` is compute-bound, priced by
FLOPs / peak FLOP/s, every other op memory-bound) and the saved-tensor analysis
(``passes/capture/saved.py``: ``selective_save``, ``saved_as``) with the runtime's selective
checkpointing policy (``runtime/recompute.py``). No reader finds an op by its name.

A compute-bound op (a model's own matmul-like kernel)::

    register_rule("mylib::gated_mm", facts=OpFacts(
        flops=lambda call: 2.0 * call.outputs[0].numel * call.inputs[0].shape[-1],
        gemm_operands=(0, 1)))       # priced at the GEMM efficiency of its (A, B) shape

May import: torch only (this is ``passes`` vocabulary: every stage may read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["OpFacts", "OP_FACTS", "register_facts", "op_facts", "find_registered", "qualified_names"]


@dataclass(frozen=True)
class OpFacts:
    """Facts about one op (the defaults are those of an op nobody registered: memory-bound, nothing special).

    ``flops(call) -> float | None``: forward FLOPs (2 per multiply-add) of one call (an ``OpCall``:
    ``inputs``/``outputs`` TensorMetas, ``args``); set = compute-bound. None from it: price it as a
    memory-bound op after all (a shape it does not cover).
    ``grad_operands``: operand indices (``passes.graph.operands`` order) whose gradient costs one forward
    each (a GEMM's backward is one GEMM per differentiable matrix operand); ``bias_operand``: the operand
    whose gradient is a sum of the output gradient (one launch, no FLOPs), None if none.
    ``gemm_operands``: (A, B) operand indices of a GEMM ``out = A @ B`` (leading dims of a 2-D B folded into
    M, a batched B a batch): the op is then priced at the achieved efficiency of that shape
    (``passes/cost/kernels.py``), not at peak. ``attention``: priced as fused attention (causal work
    halved, backward recomputes the scores; ``hardware.attention_*``). ``backward_gemms``: a fixed
    number of forward-sized GEMMs its backward runs whenever its output needs a gradient (MoE
    experts: input and weight gradients), instead of ``grad_operands``.
    ``selective_save``: selective checkpointing keeps this kernel's outputs (a dispatch-level kernel:
    matmuls and fused attention; the runtime's policy and the cost model agree through this).
    ``saved_as(args, kwargs) -> value | None``: what the saved-tensor analysis runs in the op's place (the
    kernel the device would really run), None where the op itself runs.
    """
    flops: Optional[Callable[[Any], Optional[float]]] = None
    grad_operands: tuple[int, ...] = (0, 1)
    bias_operand: Optional[int] = 2
    gemm_operands: Optional[tuple[int, int]] = None
    attention: bool = False
    backward_gemms: Optional[int] = None
    selective_save: bool = False
    saved_as: Optional[Callable[[tuple, dict], Any]] = None

    @property
    def compute_bound(self) -> bool:
        return self.flops is not None


OP_FACTS: dict[Any, OpFacts] = {}


def register_facts(*targets, facts: OpFacts) -> None:
    """Record ``facts`` for each op given (an overload, a packet: all its overloads, or a qualified name)."""
    for t in targets:
        if t in OP_FACTS:
            raise ValueError(f"two sets of op facts registered for {t}")
        OP_FACTS[t] = facts


def qualified_names(target) -> list[str]:
    """``"ns::op.overload"`` and ``"ns::op"`` for an op overload; [] for anything without a schema."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    overload = getattr(target, "_overloadname", None) or "default"
    return [f"{schema.name}.{overload}", schema.name]


def find_registered(table: dict, target):
    """``table``'s entry for ``target``: the overload itself, else its packet, else its qualified name
    (overload, then op); None if none."""
    if target in table:
        return table[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in table:
        return table[packet]
    for name in qualified_names(target):
        if name in table:
            return table[name]
    return None


_EMPTY = OpFacts()


def op_facts(target) -> OpFacts:
    """The facts registered for ``target`` (found as rules are found), else those of a plain memory-bound op.
    The table is filled by importing ``passes.sharding.rules``; readers in later stages import it."""
    if not OP_FACTS:  # read before the rules were imported: every op would silently be memory-bound
        raise RuntimeError("op facts read before any was registered: import autoshard.passes.sharding.rules "
                           "first (it registers them with the sharding rules)")
    found = find_registered(OP_FACTS, target)
    return found if found is not None else _EMPTY
