"""The emitters of the special lowerings ``passes/cost/lowerings.py`` registers, by the same names.

A strategy's ``lowerings[a]`` names the lowering used on mesh axis ``a``; when one name is on
several axes they act as one flattened axis (reductions run over all of them). Each emitter
appends plain calls to the program, its collectives explicit:

- ``mean_partial``: ``mean(local) * local_count / global_count`` (output P).
- ``loss_mean_partial``: the loss with ``reduction=sum`` over the local elements, divided by the
  global count. With class indices (cross_entropy / nll_loss) the count is the total weight of
  the targets that are not ``ignore_index`` (class ``weight`` applied), summed over the axes by an
  all-reduce outside autograd; otherwise it is the static global element (or sample) count.
- ``batch_norm_sync``: per-channel ``sum(x - K)`` and ``sum((x - K)^2)`` all-reduced together
  (differentiably; K = the running mean, a constant shift for accuracy), giving the global batch
  mean and variance; running stats updated in place with them, identically on every rank
  (``batch_norm_sync.py``: it keeps for the backward what ``aten.batch_norm`` keeps).
- ``embedding_vocab``: look up the rows this rank owns (rows ``start .. start+local_rows``), zeros
  for indices owned elsewhere (output P).
- ``expert_dispatch``: MoE experts sharded over the axes, tokens moved by all-to-all
  (``runtime/moe_dispatch.py``).
- ``ring_attention``: ``ring_attention(q, k, v, mask, is_causal, scale, comm, layout)`` over the axes
  flattened (``runtime/ring_attention.py``); its first result is the attention output. ``layout`` is
  "zigzag" (causal load balance, permuted inside the call) for causal self-attention without a mask
  whose local chunks halve, else "contiguous".
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import operand_meta, operands
from autoshard.passes.layout.shapes import local_offsets, local_shape, normalize
from autoshard.passes.sharding.rules.attention import ring_layout
from autoshard.passes.schema import bind_args, rebuild_args
from autoshard.passes.cost.lowerings import LOWERINGS
from autoshard.passes.spec import Strategy

from . import collectives as C
from .batch_norm_sync import bn_apply, bn_local_stats
from .moe_dispatch import emit_expert_dispatch
from .ring_attention import ring_attention

aten = torch.ops.aten

__all__ = ["emit_lowering", "EMITTERS", "register_emitter", "loss_weight_total", "bn_local_stats", "bn_apply",
           "vocab_embedding"]

_SUM = 2  # at::Reduction::Sum
_MEAN = 1


# ---- functions the emitted program calls -----------------------------------------------------

def loss_weight_total(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Local total weight of the counted targets (a 0-d tensor outside autograd)."""
    with torch.no_grad():
        keep = target != ignore_index
        if weight is None:
            return keep.sum().to(dtype)
        w = weight.detach()[target.masked_fill(~keep, 0)]
        return (w * keep).sum().to(dtype)


def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, start: int, padding_idx: int,
                    scale_grad_by_freq: bool, sparse: bool) -> torch.Tensor:
    """Rows ``start .. start + weight.shape[0]`` of the vocabulary; zeros for the others."""
    rows = weight.shape[0]
    local = indices - start
    outside = (local < 0) | (local >= rows)
    local = local.masked_fill(outside, 0)
    pad = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + rows else -1
    out = aten.embedding.default(weight, local, pad, scale_grad_by_freq, sparse)
    return out.masked_fill(outside.unsqueeze(-1), 0)


# ---- emitters ---------------------------------------------------------------------------------

def _mean_partial(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, axes: tuple) -> fx.Node:
    meta = operand_meta(operands(node)[0])
    placement = normalize(strategy.inputs[0], ctx.mesh.shape)
    local = local_shape(meta.shape, placement, ctx.mesh.shape)
    bound = bind_args(node.target, args, kwargs)
    dims = bound.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    dims = range(len(meta.shape)) if not dims else [d % len(meta.shape) for d in dims]
    factor = math.prod(local[d] for d in dims) / math.prod(meta.shape[d] for d in dims)
    out = ctx.graph.call_function(node.target, args, kwargs)
    return ctx.graph.call_function(aten.mul.Tensor, (out, factor))


def _loss_mean_partial(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, axes: tuple) -> fx.Node:
    bound = bind_args(node.target, args, kwargs)
    if bound.get("reduction") != _MEAN:
        raise PlanFormatError(f"node {node.name}: 'loss_mean_partial' needs reduction=mean, "
                              f"got {bound.get('reduction')}")
    meta = operand_meta(operands(node)[0])
    bound["reduction"] = _SUM
    new_args, new_kwargs = rebuild_args(node.target, bound)
    local_sum = ctx.graph.call_function(node.target, new_args, new_kwargs)
    target_meta = operand_meta(operands(node)[1])
    if "ignore_index" in bound and not target_meta.dtype.is_floating_point:
        weight_total = ctx.graph.call_function(
            loss_weight_total, (bound["target"], bound.get("weight"), bound["ignore_index"], meta.dtype))
        total = ctx.collective(C.all_reduce, (weight_total,), axes)
        return ctx.graph.call_function(aten.div.Tensor, (local_sum, total))
    if "ignore_index" in bound:  # class probabilities: mean over samples
        count = meta.numel // meta.shape[1] if len(meta.shape) >= 2 else 1
    else:
        count = meta.numel
    return ctx.graph.call_function(aten.div.Tensor, (local_sum, float(count)))


def _batch_norm_sync(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, axes: tuple) -> fx.Node:
    if node.target != aten.batch_norm.default:
        raise PlanFormatError(f"node {node.name}: 'batch_norm_sync' lowers aten.batch_norm.default, not {node.target}")
    b = bind_args(node.target, args, kwargs)
    if not b["training"]:
        return ctx.graph.call_function(node.target, args, kwargs)
    if b["momentum"] is None:
        raise PlanFormatError(f"node {node.name}: batch norm with momentum=None (cumulative average) is not supported "
                              "sharded; give the BatchNorm a momentum or pin its input replicated")
    meta = operand_meta(operands(node)[0])
    count = meta.numel // meta.shape[1]
    local = ctx.graph.call_function(bn_local_stats, (b["input"], b["running_mean"]))
    stats = ctx.collective(C.all_reduce, (local,), axes)
    return ctx.graph.call_function(bn_apply, (b["input"], stats, b["weight"], b["bias"], b["running_mean"],
                                              b["running_var"], float(b["momentum"]), float(b["eps"]), count))


def _embedding_vocab(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, axes: tuple) -> fx.Node:
    b = bind_args(node.target, args, kwargs)
    meta = operand_meta(operands(node)[0])
    placement = normalize(strategy.inputs[0], ctx.mesh.shape)
    start = local_offsets(meta.shape, placement, ctx.mesh.shape, ctx.env.coordinate)[0]
    return ctx.graph.call_function(vocab_embedding, (b["weight"], b["indices"], start, b["padding_idx"],
                                                     b["scale_grad_by_freq"], b["sparse"]))


def _ring_attention(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy, axes: tuple) -> fx.Node:
    b = bind_args(node.target, args, kwargs)
    if node.target != aten.scaled_dot_product_attention.default or b["dropout_p"]:
        raise PlanFormatError(f"node {node.name}: 'ring_attention' lowers aten.scaled_dot_product_attention "
                              f"without dropout, not {node.target} with dropout_p={b.get('dropout_p')}")
    q_len, kv_len = (operand_meta(o).shape[-2] for o in operands(node)[:2])
    ring_size = math.prod(ctx.mesh.shape[a] for a in axes)
    layout = ring_layout(bool(b["is_causal"]), b["attn_mask"] is not None, q_len, kv_len, ring_size)
    both = ctx.graph.call_function(ring_attention, (b["query"], b["key"], b["value"], b["attn_mask"],
                                                    b["is_causal"], b["scale"], ctx.comm(axes), layout))
    return ctx.graph.call_function(operator.getitem, (both, 0))


#: lowering name -> emitter; every name is a ``Lowering`` of ``passes/cost/lowerings.LOWERINGS`` and every
#: descriptor has an emitter (``tests/runtime/test_lowering_registry.py``)
EMITTERS: dict[str, Callable] = {}


def register_emitter(name: str, emitter: Callable) -> None:
    """Register ``emitter(ctx, node, args, kwargs, strategy, axes)`` for the registered lowering ``name``."""
    if name not in LOWERINGS:
        raise KeyError(f"no Lowering named {name!r} in passes/cost/lowerings.py (known: {sorted(LOWERINGS)}): "
                       "register its descriptor there first")
    if name in EMITTERS:
        raise KeyError(f"lowering {name!r} already has an emitter")
    EMITTERS[name] = emitter


for _name, _emitter in (("mean_partial", _mean_partial), ("loss_mean_partial", _loss_mean_partial),
                        ("batch_norm_sync", _batch_norm_sync), ("embedding_vocab", _embedding_vocab),
                        ("expert_dispatch", emit_expert_dispatch), ("expert_dispatch_capacity", emit_expert_dispatch),
                        ("ring_attention", _ring_attention)):
    register_emitter(_name, _emitter)


def emit_lowering(ctx, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> fx.Node:
    """Emit ``node`` under the lowerings its strategy names; returns the node holding its output.

    ``ctx`` (from lower.py) offers ``graph``, ``mesh``, ``env`` and ``collective(fn, args, axes)``.
    Only axes of size > 1 count; if none remain, the op runs as is.
    """
    names: dict[str, list[int]] = {}
    for a, name in enumerate(strategy.lowerings):
        if name and ctx.mesh.shape[a] > 1:
            names.setdefault(name, []).append(a)
    if not names:
        return ctx.graph.call_function(node.target, args, kwargs)
    if len(names) > 1:
        raise PlanFormatError(f"node {node.name}: strategy {strategy} names several lowerings {sorted(names)}")
    (name, axes), = names.items()
    if name not in EMITTERS:
        raise PlanFormatError(f"node {node.name}: unknown lowering {name!r}; known: {sorted(EMITTERS)}")
    return EMITTERS[name](ctx, node, args, kwargs, strategy, tuple(axes))
