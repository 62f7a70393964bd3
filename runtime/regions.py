"""Checkpoint regions: the lowered program cut so that each checkpointed block instance runs through
``recompute.checkpointed``.

The lowering tags every node it emits with the block instance of the captured op it lowers
(``node.meta[BLOCK]``: "blocks.3", or None outside numbered blocks; the collectives and parameter
gathers emitted for an op belong to that op). ``outline_regions`` gives each maximal run of
consecutive nodes of one block instance whose policy checkpoints its own partition
(``torch.fx.passes.split_module``, the policy as the callback; the nodes between such runs form
partitions of their own, called as they are) and wraps it in a ``CheckpointRegion``:

    blocks_1 = self.submod_3(layer_norm_1, p_blocks_1_q_weight, ..., comm_dp)   # a CheckpointRegion

A region's arguments that it writes in place (the program's buffers, and any argument an op of the
region writes according to its schema) are replayed from copies on the re-run (``recompute.Replay``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from .recompute import checkpointed

__all__ = ["BLOCK", "CheckpointRegion", "outline_regions"]

BLOCK = "autoshard.block"


class CheckpointRegion(nn.Module):
    """One block instance's part of the program, run under ``checkpointed`` with ``policy``."""

    def __init__(self, body: fx.GraphModule, block: str, policy: str, writable: tuple[int, ...]):
        super().__init__()
        self.body, self.block, self.policy, self.writable = body, block, policy, writable

    def forward(self, *args):
        return checkpointed(self.body, args, policy=self.policy, writable=self.writable)

    def extra_repr(self) -> str:
        return f"block={self.block!r}, policy={self.policy!r}, writable={list(self.writable)}"


def _written_placeholders(body: fx.GraphModule) -> set[str]:
    """Names of the body's placeholders that one of its ops writes in place (by the op's schema)."""
    out = set()
    for node in body.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(value, fx.Node) and value.op == "placeholder":
                out.add(value.name)
    return out


def outline_regions(program: fx.GraphModule, policy_of: Callable[[Optional[str]], str],
                    buffers: set[str]) -> fx.GraphModule:
    """``program`` with its checkpointed block runs outlined (see the module docstring); ``policy_of``
    maps a block instance (or None) to "none" or a ``recompute.POLICIES`` name; ``buffers``: names of the
    program's placeholders holding buffers. Returns ``program`` itself when nothing is checkpointed."""
    partition: dict[fx.Node, int] = {}
    checkpointed_parts: dict[int, tuple[str, str]] = {}
    current, key = -1, object()
    for node in program.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        block = node.meta.get(BLOCK)
        policy = policy_of(block) if block is not None else "none"
        this = (block, policy) if policy != "none" else None
        if this != key:
            current, key = current + 1, this
            if this is not None:
                checkpointed_parts[current] = this
        partition[node] = current
    if not checkpointed_parts:
        return program
    split = split_module(program, program, lambda n: partition[n], keep_original_order=True,
                         keep_original_node_name=True)
    for node in split.graph.nodes:
        if node.op != "call_module" or not node.target.startswith("submod_"):
            continue
        part = int(node.target.rsplit("_", 1)[1])
        if part not in checkpointed_parts:
            continue
        body = getattr(split, node.target)
        written = _written_placeholders(body)
        names = [n.name for n in body.graph.nodes if n.op == "placeholder"]
        writable = tuple(i for i, (a, name) in enumerate(zip(node.args, names))
                         if name in written or (isinstance(a, fx.Node) and a.op == "placeholder" and a.name in buffers))
        block, policy = checkpointed_parts[part]
        setattr(split, node.target, CheckpointRegion(body, block, policy, writable))
    split.recompile()
    return split
