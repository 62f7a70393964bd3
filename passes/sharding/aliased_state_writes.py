"""Parameters and buffers written in place through an alias are held whole, so the write lands in them.

``F.embedding(ids, weight, max_norm=1.0)`` renormalises the rows it looks up in place through a detached
alias of the weight (``embedding_renorm_(weight.detach(), ids, ...)``) and then reads the weight. On one
device the write lands in the weight's storage: the lookup that follows and every later step see it. In a
per-rank program an operand reached through a move (a shard gathered, a chunk taken) is a private copy,
and the runtime writes an update back only into an operand that is the parameter or buffer itself
(``runtime/lower.py``, ``write_backs``), not into one reached through ``detach`` or a view. So a plan that
shards such a tensor, or reads the alias split, loses the write: the forward and the next steps differ
from one device, silently.

``narrow_for_aliased_writes`` narrows the allowed strategies so that the alias is the stored tensor on
every rank: the parameter or buffer is held whole (storage ``R`` on every axis: replicated, or a ZeRO-1/2
form, which keeps the parameter whole; never FSDP), every alias on the way (``detach``, ``alias``, the view
ops) reads and makes ``R``, and the writing op reads that operand ``R`` (an op without a sharding rule
reads everything ``R`` anyway, its other operands gathered: ``embedding_renorm_`` then renormalises the
rows of the whole batch's ids, as on one device). Writes into the parameter or buffer directly (batch
norm's running statistics) need nothing here: the runtime writes those back into any stored piece.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from autoshard.passes.graph import CapturedGraph, operands
from autoshard.passes.sharding.pins import PinError
from autoshard.passes.spec import Replicate
from autoshard.passes.writes import aliases_first_operand, written_operands

__all__ = ["AliasedWrites", "aliased_state_writes", "narrow_for_aliased_writes"]




@dataclass
class AliasedWrites:
    """What must read the stored tensor whole: ``state`` (parameter and buffer placeholders written through
    an alias), ``aliases`` (the alias nodes between them and the writers), ``writers`` (writing node ->
    the operand indices it writes through an alias) and ``why`` (state name -> the writing node's name and op,
    for messages)."""
    state: set[str] = field(default_factory=set)
    aliases: set[str] = field(default_factory=set)
    writers: dict[str, set[int]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.state)


def aliased_state_writes(captured: CapturedGraph) -> AliasedWrites:
    """Every in-place write of ``captured`` into a parameter or buffer through a chain of ``ALIAS_OPS``."""
    state = set(captured.params) | set(captured.buffers)
    found = AliasedWrites()
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        written = written_operands(node)
        if not written:
            continue
        ops = operands(node)
        for i in written:
            chain, src = [], ops[i].node
            while isinstance(src, fx.Node) and src.op == "call_function" and src.args and aliases_first_operand(src):
                chain.append(src.name)
                src = src.args[0]
            if chain and isinstance(src, fx.Node) and src.op == "placeholder" and src.name in state:
                found.state.add(src.name)
                found.aliases.update(chain)
                found.writers.setdefault(node.name, set()).add(i)
                found.why.setdefault(src.name, f"{node.name} ({node.target})")
    return found


def _whole(placements) -> bool:
    return all(isinstance(p, Replicate) for p in placements)


def narrow_for_aliased_writes(captured: CapturedGraph, table, allowed: dict) -> dict:
    """``allowed`` (node -> allowed strategy indices; absent: all of ``table[node]``) narrowed as the module
    docstring says; the same dict when nothing is written through an alias. Raises ``PinError`` when a pin
    leaves such a node no whole strategy (naming the tensor and the op that writes it)."""
    found = aliased_state_writes(captured)
    if not found:
        return allowed
    out = {k: set(v) for k, v in allowed.items()}

    def keep(name: str, ok, what: str) -> None:
        idx = {k for k in out.get(name, range(len(table[name]))) if ok(table[name][k])}
        if not idx:
            raise PinError(f"{what}: no allowed strategy keeps it whole (R on every mesh axis), and it must be: "
                           f"{_culprit(found, name)} writes into it in place through an alias, which reaches the "
                           "stored tensor only when every rank holds it whole; drop the pin that splits it")
        out[name] = idx

    for name in found.state:
        keep(name, lambda s: bool(s.outputs) and _whole(s.outputs[0]), f"{name!r} (stored)")
    for name in found.aliases:
        keep(name, lambda s: all(_whole(p) for p in s.inputs[:1]) and all(_whole(p) for p in s.outputs),
             f"node {name!r} (an alias of a written parameter or buffer)")
    for name, idx in found.writers.items():
        keep(name, lambda s, idx=idx: all(_whole(s.inputs[i]) for i in idx if i < len(s.inputs)),
             f"node {name!r} (writes a parameter or buffer in place)")
    return {k: sorted(v) for k, v in out.items()}


def _culprit(found: AliasedWrites, name: str) -> str:
    if name in found.why:
        return f"op {found.why[name]}"
    return "an op (" + ", ".join(sorted(found.why.values())) + ")"
