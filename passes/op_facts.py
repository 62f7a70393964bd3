"""What the compiler knows of an op besides its sharding rule: how its work is priced and what autograd
keeps of it. One table, ``OP_FACTS``, keyed as the rules are (an ``OpOverload``, its packet for every
overload, a qualified name ``"ns::op"``, or a Python callable such as ``operator.getitem``), filled beside each rule: ``register_rule(..., facts=...)``
or ``register_facts(op, facts=...)`` in the rule's family module (``passes/sharding/rules/``).

Readers: the cost model (``passes/cost/facts.py``: an op with ``flops`` is compute-bound, priced by
FLOPs / peak FLOP/s, every other op memory-bound, by its kernel class and byte rule; views, free calls
and ops without a gradient) and the saved-tensor analysis
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
from typing import Any, Callable, Optional, Union

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

    A memory-bound op (no ``flops``) is priced by the bytes its kernels move at its kernel class's rate
    (``passes/cost/kernel_classes.py``): ``kernel_class``, a key of ``CLASS_RATIO`` or a function of the
    call's operand metas; ``memory_bytes(node, in_metas, out_metas) -> (forward, backward) | None``, the
    bytes its forward and backward kernels move, None (or unset): operand + output bytes both ways.
    ``view``: the op returns its operand or a view of it (free on the device, still one dispatch), or a
    function of the fx node saying so per call; ``transposing``: a view whose result is not contiguous
    (a ``contiguous`` of it copies); ``free_call``: not an ATen dispatch at all (``operator.getitem``);
    ``no_grad``: its output never carries a gradient (``detach``, ``*_like`` constructors).
    """
    flops: Optional[Callable[[Any], Optional[float]]] = None
    grad_operands: tuple[int, ...] = (0, 1)
    bias_operand: Optional[int] = 2
    gemm_operands: Optional[tuple[int, int]] = None
    attention: bool = False
    backward_gemms: Optional[int] = None
    selective_save: bool = False
    saved_as: Optional[Callable[[tuple, dict], Any]] = None
    kernel_class: Union[str, Callable[[list], str]] = "elementwise"
    memory_bytes: Optional[Callable[[Any, list, list], Optional[tuple[float, float]]]] = None
    view: Union[bool, Callable[[Any], bool]] = False
    transposing: bool = False
    free_call: bool = False
    no_grad: bool = False

    @property
    def compute_bound(self) -> bool:
        return self.flops is not None

    def class_of(self, in_metas: list) -> str:
        """The memory-bound kernel class of one call with operand metas ``in_metas``."""
        return self.kernel_class(in_metas) if callable(self.kernel_class) else self.kernel_class

    def is_view(self, node) -> bool:
        """Whether this call (an fx node) returns (a view of) its operand: no kernel runs, no storage."""
        return self.view(node) if callable(self.view) else self.view


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
