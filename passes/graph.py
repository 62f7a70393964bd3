"""The captured program and the small vocabulary every pass uses to walk it.

``capture`` (passes/capture/export.py) produces a ``CapturedGraph``: an ATen-level ``torch.fx``
GraphModule whose placeholders are, in order, the parameters, the buffers, the user inputs and
(when a loss function is given) the target. Every node carries namespaced metadata:

- ``node.meta["autoshard.meta"]``: a ``TensorMeta`` (one tensor), a tuple of ``TensorMeta`` /
  ``None`` (several outputs, e.g. ``aten.split``), or ``None`` (no tensor output).
- ``node.meta["autoshard.module"]``: dotted path of the innermost ``nn.Module`` that produced the
  node ("" for the top level), used to cluster repeated blocks and to draw the partition.

An *operand* of a node is one tensor value it reads: ``Operand(node, index)`` where ``index`` is
None for a single-tensor producer and the output position for a ``getitem`` of a multi-output op.
Operands are listed in flattened ``(args, kwargs)`` order, duplicates kept (``mul(x, x)`` has two).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.fx as fx

from autoshard.passes.spec import TensorMeta

META = "autoshard.meta"
MODULE = "autoshard.module"


class Operand(NamedTuple):
    node: fx.Node
    index: Optional[int]


@dataclass
class CapturedGraph:
    """A traced training program: ``gm(*params, *buffers, *inputs[, target]) -> output``.

    ``params`` maps placeholder name -> parameter FQN (one placeholder per distinct tensor; tied
    weights appear once under their canonical name); ``aliases`` maps every other FQN that names the
    same tensor -> canonical FQN; ``buffers`` maps placeholder name -> buffer FQN; ``inputs`` lists
    user-input placeholder names in call order; ``target`` is the target placeholder or None.
    ``loss_output`` is True when the single output is a scalar loss. ``master_dtypes``: parameter
    placeholder -> the model's own dtype, for parameters traced as compute copies in another dtype
    (``capture(..., param_dtype=)``: the graph's placeholders carry the compute dtype).
    """
    gm: fx.GraphModule
    params: dict[str, str]
    buffers: dict[str, str]
    inputs: list[str]
    target: Optional[str]
    aliases: dict[str, str] = field(default_factory=dict)
    loss_output: bool = False
    method: str = "export"
    master_dtypes: dict[str, Any] = field(default_factory=dict)
    #: forward-only programs of a model returning more than a tensor or a tuple of tensors (a
    #: ModelOutput, a dataclass, a dict): ``rebuild(tensors)`` gives the model's own output object
    #: back from the program's tensors (``passes.capture.outputs.OutputStructure``); else None
    output_structure: Any = None
    #: a pipeline stage before the last of a training program: it returns activations whose gradients
    #: arrive from the next stage, so it is trained (gradients, optimizer state, backward) like a
    #: program returning a loss (``runtime.pipeline.split``)
    receives_output_grads: bool = False

    @property
    def training(self) -> bool:
        """Whether a step of this program runs a backward (it returns a loss, or is a stage before one)."""
        return bool(self.loss_output or self.receives_output_grads)

    def node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the captured graph")

    @property
    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")


def exact_placeholder(graph: fx.Graph, name: str) -> fx.Node:
    """A placeholder whose node name and target are exactly ``name``.

    ``fx.Graph.placeholder(name)`` derives the node's name from its target in snake case
    (``p_A_log`` -> ``p_a_log``), while plans, captured params and stage boundaries are keyed by
    the captured node names, which keep the model's capitals (Mamba's ``A_log``, ``D``)."""
    return graph.create_node("placeholder", name, name=name)


def tensor_meta_of(value: Any):
    """Convert a ``meta["val"]``-like value (tensor, FakeTensor, tuple) to TensorMeta form."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(tensor_meta_of(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def outputs(node: fx.Node) -> list[Optional[TensorMeta]]:
    """The node's tensor outputs as a list (one entry for a single tensor, [] for none)."""
    m = node.meta.get(META)
    if m is None:
        return []
    if isinstance(m, TensorMeta):
        return [m]
    return list(m)


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def operands(node: fx.Node) -> list[Operand]:
    """Tensor operands of ``node`` in flattened (args, kwargs) order, duplicates kept."""
    if is_getitem(node):
        src, idx = node.args
        return [Operand(src, int(idx))]
    found: list[Operand] = []

    def visit(a):
        if isinstance(a, fx.Node):
            if isinstance(a.meta.get(META), TensorMeta):
                found.append(Operand(a, None))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(node.args)
    visit(node.kwargs)
    return found


def operand_meta(op: Operand) -> TensorMeta:
    m = op.node.meta[META]
    return m if op.index is None else m[op.index]
