"""What a mean class loss divides by, per microbatch: so accumulation and pipelines weigh microbatches as one batch.

``F.cross_entropy(logits, labels)`` (and ``nll_loss``) with the default ``reduction="mean"`` divides the
summed losses by the number of targets that are not ``ignore_index`` (-100 by default: the padding of
every causal-LM recipe). One device divides by the whole batch's count. A step run as k microbatches
(gradient accumulation, pipeline microbatches) averages k microbatch means, each divided by its own
count: when the microbatches hold different numbers of padded tokens, that is another loss and other
gradients (the "gradient accumulation bug" Hugging Face fixed in transformers 4.46 by passing
``num_items_in_batch``). Weighting microbatch i by ``n_i / N`` (its count over the step's) instead of
``1 / k`` gives back one device's loss and gradients exactly.

``loss_counts(captured)`` finds the class losses of a training program that divide by such a count
(integer targets, mean reduction, no class ``weight``) and builds one small program per loss computing
the count from a microbatch's inputs and target (the target operand's ancestors, which must read no
parameter or buffer: Hugging Face's shift and pad of the labels are kept). ``exact``: the program's loss
is that one class loss times constants (views, casts, ``mul``/``div`` by numbers), so the weights make
the step exact; with other terms added (an auxiliary loss), no single weight per microbatch can, and
the runtime says so when the counts differ (``runtime.step_weights``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.schema import bind_args

__all__ = ["LossCounts", "loss_counts"]

aten = torch.ops.aten

_CLASS_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
                 aten.nll_loss2d.default}
_MEAN = 1
# ops that keep a scalar loss a constant multiple of its operand
_SCALING = {aten.clone.default, aten.alias.default, aten.detach.default, aten.view.default, aten._unsafe_view.default,
            aten.reshape.default, aten.squeeze.default, aten.squeeze.dim, aten.unsqueeze.default,
            aten._to_copy.default, aten.to.dtype, aten.contiguous.default, aten.mul.Tensor, aten.div.Tensor,
            aten.neg.default}


@dataclass
class LossCounts:
    """The class-mean losses of a program: ``programs[i](*inputs, target)`` counts loss ``losses[i]``'s
    non-ignored targets in one microbatch (a 0-d int64 tensor); ``exact``: the program's loss is one
    such loss times constants (module docstring)."""
    losses: list[str] = field(default_factory=list)
    programs: list[fx.GraphModule] = field(default_factory=list)
    exact: bool = False

    def __bool__(self) -> bool:
        return bool(self.programs)


def loss_counts(captured: CapturedGraph, device=None) -> LossCounts:
    """``LossCounts`` of ``captured`` (empty for a program without a loss, or whose losses' denominators
    do not depend on the data); ``device``: where the counting programs run (the ``device`` arguments
    the trace recorded are replaced by it)."""
    found = LossCounts()
    if not captured.loss_output:
        return found
    readable = set(captured.inputs) | ({captured.target} if captured.target else set())
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CLASS_LOSSES:
            continue
        args = bind_args(node.target, node.args, node.kwargs)
        target = args["target"]
        meta = target.meta.get(META) if isinstance(target, fx.Node) else None
        if int(args["reduction"]) != _MEAN or meta is None or meta.dtype.is_floating_point:
            continue  # a sum, per-element losses, or probabilities as targets: nothing counted
        if args.get("weight") is not None:
            continue  # a class-weighted mean: its denominator is batch-coupled (passes.batch_coupling)
        program = _count_program(captured, target, int(args["ignore_index"]), readable, device)
        if program is None:
            continue
        found.losses.append(node.name)
        found.programs.append(program)
    found.exact = len(found.losses) == 1 and _scales(_loss_output(captured), found.losses[0])
    return found


def _loss_output(captured: CapturedGraph) -> Optional[fx.Node]:
    out = captured.output_node.args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if isinstance(out, fx.Node) else None


def _scales(node: Optional[fx.Node], loss: str) -> bool:
    """Whether ``node`` is ``loss`` times constants."""
    while isinstance(node, fx.Node):
        if node.name == loss:
            return True
        if node.op != "call_function" or node.target not in _SCALING:
            return False
        tensors = [a for a in node.all_input_nodes]
        if len(tensors) != 1 or not all(isinstance(a, (fx.Node, numbers.Number, torch.dtype, torch.device, list,
                                                       tuple, type(None), torch.memory_format))
                                        for a in node.args):
            return False
        node = tensors[0]
    return False


def _count_program(captured: CapturedGraph, target: fx.Node, ignore_index: int, readable: set, device
                   ) -> Optional[fx.GraphModule]:
    """``(*inputs, target) -> (target != ignore_index).sum()``, or None when the target reads state."""
    needed, todo = set(), [target]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder" and n.name not in readable:
            return None
        if n.op not in ("placeholder", "call_function", "get_attr"):
            return None
        todo.extend(n.all_input_nodes)
    graph, env = fx.Graph(), {}
    for name in list(captured.inputs) + ([captured.target] if captured.target else []):
        env[captured.node(name)] = graph.placeholder(name)
    for n in captured.gm.graph.nodes:
        if n in needed and n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
            if device is not None and "device" in n.kwargs:
                env[n].kwargs = {**n.kwargs, "device": torch.device(device)}
    kept = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (kept,)))
    return fx.GraphModule(captured.gm, graph)  # copies the constants its get_attr nodes read
