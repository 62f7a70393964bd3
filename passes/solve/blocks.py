"""Which repeated-block instance every node belongs to, and which values leave their block.

Memory levers act per block type (``passes.levers``): a checkpointed block keeps only what leaves
it (and, selectively, its matmul outputs) and recomputes the rest before its backward. This module
answers the structural questions the pricing of those levers asks:

- ``instance[name]``: the block instance of a node (``"model.layers.3"``, from its module path, a
  parameter's from its FQN; ``passes.solve.clustering.block_instance``), absent outside numbered
  blocks (embedding, head, loss, inputs);
- ``types[block_type]``: the instances of each block type (``"model.layers.#"``), in graph order;
- ``leaving[name]``: the tensor slots of an op's own outputs that something outside its instance
  reads (directly or through views: a view's storage is its base's, ``passes.capture.saved``), or
  the program returns: what a checkpointed block must keep.

>>> blocks = block_map(captured, facts)                          # doctest: +SKIP
>>> blocks.types["blocks.#"], blocks.leaving["add_2"]             # doctest: +SKIP
(['blocks.0', 'blocks.1'], (0,))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.graph import CapturedGraph, operands
from autoshard.passes.levers import block_type
from autoshard.passes.solve.clustering import block_instance, module_path, output_slot

__all__ = ["BlockMap", "block_map", "storage_owner"]


@dataclass
class BlockMap:
    """See the module docstring."""
    instance: dict[str, str] = field(default_factory=dict)
    types: dict[str, list[str]] = field(default_factory=dict)
    leaving: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def type_of(self, name: str) -> Optional[str]:
        """The block type of node ``name`` (None outside numbered blocks)."""
        inst = self.instance.get(name)
        return None if inst is None else block_type(inst)

    def num_instances(self, btype: str) -> int:
        return len(self.types.get(btype, ()))


def storage_owner(facts: GraphFacts, name: str, slot: int) -> tuple[str, int]:
    """The node (and tensor slot) owning the storage of output ``slot`` of ``name``: through the
    saved-tensor analysis' alias record, else through ``facts.views`` to the first operand."""
    seen = set()
    while name not in seen:
        seen.add(name)
        info = facts.saved_of(name)
        if info is not None:
            return info.alias_of if info.alias_of is not None else (name, slot)
        node = facts.nodes[name]
        ops = operands(node) if node.op == "call_function" else []
        if name not in facts.views or not ops:
            return name, slot
        name, slot = ops[0].node.name, output_slot(ops[0].node, ops[0].index)
    return name, slot


def block_map(captured: CapturedGraph, facts: GraphFacts) -> BlockMap:
    """The block structure of ``captured`` (see the module docstring)."""
    result = BlockMap()
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        found = block_instance(module_path(node, captured))
        if found is None:
            continue
        result.instance[node.name] = found[1]
        insts = result.types.setdefault(block_type(found[1]), [])
        if found[1] not in insts:
            insts.append(found[1])
    leaving: dict[str, set[int]] = {}
    for node in captured.gm.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        here = result.instance.get(node.name) if node.op == "call_function" else None
        for op in operands(node):
            if op.node.op != "call_function":
                continue
            owner, slot = storage_owner(facts, op.node.name, output_slot(op.node, op.index))
            if facts.kind.get(owner) != "op":
                continue
            inst = result.instance.get(owner)
            if inst is not None and inst != here:
                leaving.setdefault(owner, set()).add(slot)
    result.leaving = {k: tuple(sorted(v)) for k, v in leaving.items()}
    return result
