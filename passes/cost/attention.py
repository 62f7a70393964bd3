"""Communication of context-parallel attention, priced next to the op's compute.

Ring attention (lowering ``"ring_attention"``, ``runtime/ring_attention.py``) over a ring of n ranks
(the lowering's axes flattened):

- forward: n blocks of work, n - 1 key/value chunk passes; each pass is posted before the block it
  overlaps, so only the part of a pass longer than one block's compute is exposed:
  ``(n - 1) * max(0, p2p(kv) - block_fwd)``;
- backward (training): the chunk's pass overlaps the block as in the forward, then its dk/dv
  accumulators (float32: ``g = 2 kv`` for bf16 k, v) pass after the block, n times (the last brings
  them home): ``(n - 1) * max(0, p2p(kv) - block_bwd) + n * p2p(g)``.

``kv`` is the local bytes of k plus v. Causal self-attention without a mask runs zig-zag
(``ring_layout``: balanced, about half a full block per step) after a p2p exchange of the q, k and v
halves and before one of the output, priced as one message of q + k + v + output bytes, again in the
backward for the adjoint; the op's compute stays priced as full attention over the
work divisor, as every sdpa strategy is (``facts`` counts L x S products, causal or not), so ring and
head-split attention compare on the same footing.

Memory: the ring keeps q, k, v (its operands, counted on the edges like any saved operand), the
output and a float32 log-sum-exp per query row; it never holds a whole score matrix, whatever the
saved-tensor analysis found inside the unsplit op (on the CPU, grouped-query sdpa runs the math
kernel, which keeps its L x S probabilities). ``ring_internal_bytes`` is what replaces that.

Ulysses has nothing here: it is the all-to-all redistribution ``S(seq) -> S(head)`` on the edges
into and out of a head-split attention, priced by the cost model's ``moves``.
"""
from __future__ import annotations

import math

from autoshard.passes.graph import operand_meta, operands
from autoshard.passes.sharding.rules.attention import ring_layout
from autoshard.passes.schema import bind_args
from autoshard.passes.spec import Strategy

__all__ = ["ring_attention_seconds", "ring_internal_bytes"]


def ring_attention_seconds(cm, node, strategy: Strategy, fwd: float, bwd: float) -> float:
    """Exposed communication seconds of ``node`` run under ``strategy`` (0 without the ring lowering).

    ``cm``: the ``CostModel``; ``fwd``/``bwd``: the op's one-device compute seconds."""
    axes = [a for a, low in enumerate(strategy.lowerings) if low == "ring_attention" and cm.mesh.shape[a] > 1]
    if not axes:
        return 0.0
    n = math.prod(cm.mesh.shape[a] for a in axes)
    ops = operands(node)
    kv = sum(operand_meta(ops[i]).nbytes / cm.shard_factor(strategy.inputs[i]) for i in (1, 2))
    same_node = all(cm.hardware.axis_locality(cm.mesh, a)[1] == 1 for a in axes)
    block_fwd = fwd / cm.work_divisor(strategy) / n
    seconds = (n - 1) * max(0.0, cm.p2p(kv, same_node) - block_fwd)
    if bwd > 0:
        itemsize = operand_meta(ops[1]).dtype.itemsize
        grads = kv * 4 / itemsize  # the accumulators are float32
        seconds += (n - 1) * max(0.0, cm.p2p(kv, same_node) - bwd / cm.work_divisor(strategy) / n)
        seconds += n * cm.p2p(grads, same_node)
    b = bind_args(node.target, node.args, node.kwargs)
    metas = [operand_meta(o) for o in ops[:3]]
    layout = ring_layout(bool(b["is_causal"]), b["attn_mask"] is not None, metas[0].shape[-2], metas[1].shape[-2], n)
    if layout == "zigzag":
        q = metas[0].nbytes / cm.shard_factor(strategy.inputs[0])
        permuted = cm.p2p(2 * q + kv, same_node)  # q and the output (same size with Ev = E), k and v
        seconds += permuted * (2 if bwd > 0 else 1)
    return seconds


def ring_internal_bytes(node) -> float:
    """Bytes (whole op, before splitting) ring attention keeps inside itself: the float32
    log-sum-exp, one per query row and head."""
    q = operand_meta(operands(node)[0])
    return 4.0 * q.numel / q.shape[-1]
