"""Scaled dot-product attention and its fused variants.

q is ``(N..., Hq, L, E)``, k/v ``(N..., Hkv, S, E/Ev)``, the output ``(N..., Hq, L, Ev)``. Any dim
before the last two -- batch or heads -- may be split: q, k, v and the output ``S(d)``. The
sequence dims and the head dim are never split (softmax and the scores span them). An
``attn_mask`` broadcast to ``(N..., L, S)`` is split on the matching dim, or stays ``R`` where it
has size 1 there (it broadcasts). With grouped-query attention (``Hq = g * Hkv``) splitting the
heads dim keeps each q head with its kv head as long as both head counts divide by the axis
size; that divisibility is checked later, per actual mesh size.

Example, ``sdpa(q, k, v, mask)`` with q/k/v ``(2, 4, 6, 8)`` and mask ``(2, 1, 6, 6)``::

    (S(0), S(0), S(0), S(0))->(S(0))   (S(1), S(1), S(1), R)->(S(1))

The fused ops (``_scaled_dot_product_{flash,efficient,cudnn}_attention``, ``..._for_cpu``) have
the same inputs and several outputs: those shaped like ``(N, H, L, ...)`` (output, logsumexp,
debug mask) are split with q; the rest (RNG seeds, empty placeholders) stay ``R``.

Context parallelism. ``aten.scaled_dot_product_attention`` without dropout may also split the
sequences: q ``S(L)``, k and v ``S(S)``, the mask ``S`` on its query dim (whole along the keys), the
output ``S(L)``, under the lowering ``"ring_attention"`` (key/value chunks passed around the axis,
``runtime/ring_attention.py``); ``ring_layout`` says whether that ring runs zig-zag (causal load
balance) or on contiguous chunks. Ulysses needs no rule of its own: sequence-split activations reach a
head-split sdpa (the strategies above) through the all-to-all redistribution ``S(seq) -> S(head)``.

Op facts (``passes/op_facts.py``): every attention op here is compute-bound (``attention_flops``), priced
as fused attention; the fused kernels (and ``_flash_attention_forward`` /
``_efficient_attention_forward``, which they dispatch) are those whose outputs selective checkpointing
keeps; the saved-tensor analysis runs ``aten.scaled_dot_product_attention`` as the fused kernel
(``passes.capture.saved.fused_attention_call``), as the device does, not as the meta device's math path.
"""
from __future__ import annotations

import math

import torch

from autoshard.passes.capture.saved import fused_attention_call
from autoshard.passes.op_facts import OpFacts, register_facts
from autoshard.passes.spec import Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import broadcast_placement
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten

_MASK_NAMES = ("attn_mask", "attn_bias")


def attention_flops(call):
    """``2 * batch * L * S * (E + Ev)``: the scores and the weighted sum, in full (no causal halving here);
    None without the three q, k, v operands."""
    if len(call.inputs) < 3:
        return None
    q, k, v = call.inputs[:3]
    return 2.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


_FUSED_KERNELS = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                  aten._scaled_dot_product_flash_attention.default,
                  aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_cudnn_attention.default)
register_facts(aten.scaled_dot_product_attention.default,
               facts=OpFacts(flops=attention_flops, attention=True, saved_as=fused_attention_call))
register_facts(*_FUSED_KERNELS, facts=OpFacts(flops=attention_flops, attention=True, selective_save=True))
register_facts(aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
               facts=OpFacts(selective_save=True))


@register_rule(aten.scaled_dot_product_attention.default, *_FUSED_KERNELS)
def sdpa_rule(call: OpCall) -> list[Strategy1D]:
    names = call.operand_names()
    q = call.inputs[names.index("query")].shape
    found = []
    for d in range(len(q) - 2):
        if q[d] <= 1:
            continue
        ins = []
        for name, meta in zip(names, call.inputs):
            if name == "query":
                ins.append(Shard(d))
            elif name in ("key", "value") or name in _MASK_NAMES:
                ins.append(broadcast_placement(meta, d, len(q)))  # split with q, or whole where it broadcasts
            else:
                ins.append(Replicate())
        outs = tuple(Shard(d) if len(o.shape) >= len(q) - 1 and o.shape[d] == q[d] else Replicate()
                     for o in call.outputs)
        found.append(Strategy1D(tuple(ins), outs))
    ring_ok = len(q) >= 3 and not call.bound_args.get("dropout_p")  # the ring needs a heads dim
    if call.target == aten.scaled_dot_product_attention.default and ring_ok:
        found.append(_ring_strategy(call, names, len(q)))
    return found


def _ring_strategy(call: OpCall, names: list[str], q_ndim: int) -> Strategy1D:
    """Sequence-split attention: the query sequence dim of q, mask and output, the key sequence of k, v."""
    seq = q_ndim - 2
    ins = []
    for name, meta in zip(names, call.inputs):
        if name in ("query", "key", "value"):
            ins.append(Shard(len(meta.shape) - 2))
        elif name in _MASK_NAMES:
            ins.append(broadcast_placement(meta, seq, q_ndim))
        else:
            ins.append(Replicate())
    return Strategy1D(tuple(ins), (Shard(seq),), lowering="ring_attention")


def ring_layout(is_causal: bool, has_mask: bool, q_len: int, kv_len: int, n: int) -> str:
    """How ring attention over ``n`` ranks lays out the sequence: "zigzag" for causal self-attention
    without an explicit mask whose chunks halve evenly (every rank computes the same causal work),
    else "contiguous"."""
    if is_causal and not has_mask and q_len == kv_len and n > 1 and q_len % (2 * n) == 0:
        return "zigzag"
    return "contiguous"
