"""One program on every rank: a trace put into the order and names of another trace of the same model.

A model's Python may run independent computations in an order that depends on the process.
ModernBERT's rotary embedding loops over ``set(config.layer_types)``, and a set of strings iterates in
an order set by the string hash seed, which differs in every process torchrun starts. Each rank traces
the model itself, so two ranks can hold the same ops in different orders under swapped node names
(``to_3`` computing the sliding-window frequencies on one rank and the global ones on another). A
plan is keyed by the node names of rank 0's trace, so the ranks of one stage then place the same
computation differently and call different collectives: the step hangs.

``structural_keys(captured)`` describes every node by what it computes, independent of names and of
the order of independent computations: a digest of its op, its non-tensor arguments and its inputs'
digests (placeholders by name, constants by value), numbered in graph order among nodes with the
same digest. ``align(captured, reference)`` rebuilds ``captured`` with its nodes in the reference's
order under the reference's names, each node reading what the reference's node reads (``reference``:
``structural_keys`` of rank 0's trace), so every rank runs rank 0's program; ``TraceMismatchError``
names the first op with no counterpart when the two traces are different programs.

>>> reference = structural_keys(rank0_trace)            # doctest: +SKIP
>>> mine = align(my_trace, reference)                  # my_trace with rank 0's order and names
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
import torch.fx as fx

from autoshard.passes.capture.opaque import describe_opaque, is_opaque
from autoshard.passes.errors import TraceMismatchError
from autoshard.passes.graph import CapturedGraph

__all__ = ["structural_keys", "align"]

_SMALL = 1 << 20  # constants up to this many elements are keyed by their values


def _constant_digest(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    text = f"{tuple(value.shape)}{value.dtype}"
    if not value.is_meta and value.numel() <= _SMALL:
        data = value.detach().cpu().contiguous()
        text += hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
    return text


def _argument(a: Any, digest: dict) -> str:
    if isinstance(a, fx.Node):
        return digest[a]
    if isinstance(a, torch.device):
        return f"device:{a.type}"  # cuda:0 on rank 0 is cuda:1 on rank 1
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_argument(x, digest) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_argument(v, digest)}" for k, v in a.items()) + "}"
    return repr(a)


def _digests(captured: CapturedGraph) -> dict[fx.Node, str]:
    """node -> what it computes (equal digests: the same op on the same values)."""
    digest: dict[fx.Node, str] = {}
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            text = f"placeholder:{node.target}"
        elif node.op == "get_attr":
            owner, _, leaf = node.target.rpartition(".")
            text = f"get_attr:{_constant_digest(getattr(captured.gm.get_submodule(owner), leaf))}"
        elif is_opaque(node.target):  # its key's digest may hold object addresses: the call's name only
            text = f"opaque:{describe_opaque(node)}:{_argument(node.args[1:], digest)}"
        else:
            text = f"{node.op}:{node.target}:{_argument(node.args, digest)}:{_argument(node.kwargs, digest)}"
        digest[node] = hashlib.sha1(text.encode()).hexdigest()[:16]
    return digest


def _numbered(captured: CapturedGraph, digest: dict[fx.Node, str]) -> list[tuple[fx.Node, str]]:
    seen: dict[str, int] = {}
    out = []
    for node in captured.gm.graph.nodes:
        d = digest[node]
        out.append((node, f"{d}#{seen.get(d, 0)}"))
        seen[d] = seen.get(d, 0) + 1
    return out


def _inputs(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that are nodes, in ``map_arg`` order (args, then kwargs), repeats kept."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


def structural_keys(captured: CapturedGraph) -> list[list]:
    """``[node name, key, [names of its input nodes]]`` for every node of ``captured`` in graph order
    (JSON-able)."""
    return [[node.name, key, [a.name for a in _inputs(node)]]
            for node, key in _numbered(captured, _digests(captured))]


def align(captured: CapturedGraph, reference: list) -> CapturedGraph:
    """``captured`` rebuilt as ``reference``'s program (``structural_keys`` of another trace of the same
    model): its nodes in the reference's order, under its names, each reading the nodes the reference's
    reads (two copies of one value may be swapped between traces); the ops, constants, devices and
    metadata are this trace's. ``captured`` itself when the two agree already. Raises
    ``TraceMismatchError`` when they are different programs."""
    reference = [(name, key, list(inputs)) for name, key, inputs in reference]
    digest = _digests(captured)
    mine = _numbered(captured, digest)
    if [(n.name, k, [a.name for a in _inputs(n)]) for n, k in mine] == reference:
        return captured
    by_key = {k: n for n, k in mine}
    if len(mine) != len(reference) or any(k not in by_key for _, k, _ in reference):
        missing = next(((name, k) for name, k, _ in reference if k not in by_key), None)
        extra = sorted(set(by_key) - {k for _, k, _ in reference})
        theirs = f"rank 0's {missing[0]!r} has no counterpart here" if missing else "the op counts differ"
        here = f"; this trace's {by_key[extra[0]].name!r} ({by_key[extra[0]].target}) has none on rank 0" if extra else ""
        raise _mismatch(f"{len(mine)} nodes against {len(reference)}: {theirs}{here}")
    graph = fx.Graph()
    new_of: dict[str, fx.Node] = {}        # reference name -> new node
    digest_of: dict[str, str] = {}         # reference name -> its value's digest
    for name, key, inputs in reference:
        node = by_key[key]
        names = iter(inputs)

        def arg(a: fx.Node) -> fx.Node:
            want = next(names, None)
            if want not in new_of or digest_of[want] != digest[a]:
                raise _mismatch(f"{name!r} reads {want!r} on rank 0, which computes something else here")
            return new_of[want]

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
        if node.op == "output":
            new = graph.output(args[0])
        else:
            new = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
            if new.name != name:
                raise _mismatch(f"node {name!r} could not keep its name here (got {new.name!r})")
        new.meta = dict(node.meta)
        new_of[name], digest_of[name] = new, digest[node]
    graph.lint()
    return dataclasses.replace(captured, gm=fx.GraphModule(captured.gm, graph, class_name=type(captured.gm).__name__))


def _mismatch(detail: str) -> TraceMismatchError:
    return TraceMismatchError(
        f"this rank traced the model into another program than rank 0 ({detail}). The model's forward depends "
        "on the process (its rank, or a value drawn or read while it is traced): make it trace the same on "
        "every rank")
