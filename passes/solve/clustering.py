"""Repeated blocks share decisions: cluster the nodes of identical layer instances.

A node's *module path* is the dotted path of the module that produced it (for a parameter or
buffer placeholder: its FQN). The path up to its first numeric component names a *block instance*
(``model.layers.3``); replacing numeric components by ``#`` gives the *normalized path*
(``model.layers.#.attn``). Inside one block, the instances' nodes are listed in graph order and
each node gets a signature: op kind, normalized path, target, non-tensor arguments, operand and
output shapes/dtypes, whether it needs a gradient, and which strategies it may take (pins can
differ per layer). Instances with the same signature sequence are clustered position by position:
node k of every such instance joins one cluster and takes one decision. Nodes outside numbered
blocks (embeddings, the loss, inputs) are singleton clusters.

>>> normalize("model.layers.11.mlp.fc1")
'model.layers.#.mlp.fc1'
>>> block_instance("model.layers.11.mlp.fc1")
('model.layers.#', 'model.layers.11')

The edges of the program map onto cluster edges ``(producer cluster, output slot, consumer cluster,
operand index)`` counted with multiplicity, so the ILP grows with the number of distinct blocks,
not with depth.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch.fx as fx

from autoshard.passes.graph import META, MODULE, CapturedGraph, operands, outputs
from autoshard.passes.spec import Partial, Placement, Replicate, TensorMeta

__all__ = ["Clustering", "cluster_nodes", "graph_edges", "cluster_edges", "normalize", "block_instance",
           "module_path", "output_slot", "output_placements", "OUTPUT"]

OUTPUT = "output"  # the consumer name used for the graph's outputs in edge lists


def output_placements(captured: CapturedGraph, ndim: int) -> Optional[tuple[Placement, ...]]:
    """The placements the program leaves its outputs in (what the runtime's ``lower`` fetches them
    to): a scalar loss ``P`` on every axis (the caller sums the ranks' values, and backward seeds
    it with ones), anything else gathered to ``R``. The output edge is priced as this move. None for
    a pipeline stage before the last (``captured.receives_output_grads``): it sends each output on
    where its producer placed it (``runtime/pipeline/boundaries.py``), so its output edges move
    nothing (the hop itself is the stage planner's to price)."""
    if captured.receives_output_grads:
        return None
    return ((Partial(),) if captured.loss_output else (Replicate(),)) * ndim

_NUM = re.compile(r"^\d+$")


def normalize(path: str) -> str:
    return ".".join("#" if _NUM.match(p) else p for p in path.split(".")) if path else path


def block_instance(path: Optional[str]) -> Optional[tuple[str, str]]:
    """(normalized block path, instance path) of the first numbered module on ``path``, or None."""
    if not path:
        return None
    parts = path.split(".")
    for i, p in enumerate(parts):
        if _NUM.match(p):
            return normalize(".".join(parts[: i + 1])), ".".join(parts[: i + 1])
    return None


def module_path(node: fx.Node, captured: CapturedGraph) -> Optional[str]:
    """FQN for parameter/buffer placeholders, the producing module's path for ops, None otherwise.

    For ops, ``meta["autoshard.module"]`` is used unless it names no numbered block while the
    tracer's ``nn_module_stack`` does (some containers are spelled differently by the tracer and
    the capture folds them into their parent); any consistent spelling clusters the same way.
    """
    if node.op == "placeholder":
        return captured.params.get(node.name) or captured.buffers.get(node.name)
    path = node.meta.get(MODULE)
    if path is None or block_instance(path) is None:
        stack = node.meta.get("nn_module_stack")
        if stack:
            deeper = list(stack.values())[-1][0]
            if path is None or block_instance(deeper) is not None:
                path = deeper
    return path


def output_slot(producer: fx.Node, index: Optional[int]) -> int:
    """Position among the producer's TENSOR outputs (``Strategy.outputs`` skips None outputs)."""
    if index is None:
        return 0
    return sum(1 for m in outputs(producer)[:index] if m is not None)


def graph_edges(captured: CapturedGraph) -> list[tuple[str, int, str, int]]:
    """Every (producer, output slot, consumer, operand index) of call_function and output nodes.

    Operands read from ``get_attr`` constants are left out: a constant is replicated on every rank,
    so any placement its consumer wants is a free local chunk."""
    edges = []
    for node in captured.gm.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        consumer = OUTPUT if node.op == "output" else node.name
        for i, op in enumerate(operands(node)):
            if op.node.op in ("placeholder", "call_function"):
                edges.append((op.node.name, output_slot(op.node, op.index), consumer, i))
    return edges


@dataclass
class Clustering:
    """``cluster_of[node] -> cluster id``; ``members[cid]`` lists nodes in graph order (first is the
    representative whose strategies and prices stand for all)."""
    cluster_of: dict[str, int] = field(default_factory=dict)
    members: list[list[str]] = field(default_factory=list)

    @property
    def num_clusters(self) -> int:
        return len(self.members)


def _signature(node: fx.Node, captured: CapturedGraph, path: str, extra) -> tuple:
    def freeze(a):
        if isinstance(a, fx.Node):
            m = a.meta.get(META)
            return ("T", m) if isinstance(m, TensorMeta) else ("N",)
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, freeze(v)) for k, v in a.items()))
        return repr(a)

    target = "" if node.op == "placeholder" else str(node.target)  # a placeholder's target is its name
    return (node.op, normalize(path), target, freeze(node.args), freeze(dict(node.kwargs)),
            repr(node.meta.get(META)), extra(node.name))


def cluster_nodes(captured: CapturedGraph, extra=lambda name: None) -> Clustering:
    """Cluster placeholders and call_function nodes; ``extra(name)`` adds to each node's signature
    (the planner passes the node's allowed strategies and whether it needs a gradient)."""
    nodes = [n for n in captured.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    instances: dict[str, dict[str, list[fx.Node]]] = {}
    for n in nodes:
        bi = block_instance(module_path(n, captured))
        if bi is not None:
            instances.setdefault(bi[0], {}).setdefault(bi[1], []).append(n)
    together: dict[str, list[str]] = {}  # first member -> members
    joined: set[str] = set()
    for block, insts in instances.items():
        groups: dict[tuple, list[list[fx.Node]]] = {}
        for seq in insts.values():
            sig = tuple(_signature(n, captured, module_path(n, captured) or "", extra) for n in seq)
            groups.setdefault(sig, []).append(seq)
        for seqs in groups.values():
            if len(seqs) < 2:
                continue
            for position in zip(*seqs):
                together[position[0].name] = [n.name for n in position]
                joined.update(n.name for n in position)
    result = Clustering()
    for n in nodes:
        if n.name in joined and n.name not in together:
            continue
        cid = len(result.members)
        names = together.get(n.name, [n.name])
        result.members.append(names)
        for name in names:
            result.cluster_of[name] = cid
    return result


def cluster_edges(edges: Iterable[tuple[str, int, str, int]], clustering: Clustering
                  ) -> dict[tuple[int, int, object, int], tuple[int, tuple[str, int, str, int]]]:
    """Aggregate graph edges into ``(cu, slot, cv or OUTPUT, operand) -> (multiplicity, example edge)``."""
    counts: Counter = Counter()
    example: dict = {}
    for e in edges:
        u, slot, v, i = e
        key = (clustering.cluster_of[u], slot, OUTPUT if v == OUTPUT else clustering.cluster_of[v], i)
        counts[key] += 1
        example.setdefault(key, e)
    return {k: (c, example[k]) for k, c in counts.items()}
