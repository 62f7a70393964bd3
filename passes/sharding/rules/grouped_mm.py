"""Sharding rules for grouped GEMMs: ``aten._grouped_mm`` and transformers' ``grouped_mm_fallback``.

``_grouped_mm(a, b, offs=None, bias=None, out_dtype=None)`` multiplies groups of matrices (MoE
experts). A 2-D operand is cut into groups along one dim by the cumulative ``offs`` (data: the
tokens routed to each expert); a 3-D operand's dim 0 is the group. The four forms:

==========  ===================  ==================  ====================  ==============================
form        a                    b                   out                   offs cut
==========  ===================  ==================  ====================  ==============================
2d x 3d     (M, K)               (G, K, N)           (M, N)                a's rows (tokens per expert)
3d x 3d     (G, M, K)            (G, K, N)           (G, M, N)             none (offs is None)
3d x 2d     (G, M, K)            (K, N)              (M, N)                b's columns
2d x 2d     (M, K)               (K, N)              (G, M, N)             the shared K
==========  ===================  ==================  ====================  ==============================

What this module offers, per form (``offs`` always ``R``: every rank needs every offset):

- 2d x 3d: N split (``(R, S(2)) -> S(1)``, a bias ``(G, N)`` split on N), K split
  (``(S(1), S(1)) -> P``), and ``P`` through either operand.
- 3d x 3d: G (``(S(0), S(0)) -> S(0)``), M (``(S(1), R) -> S(1)``), N (``(R, S(2)) -> S(2)``), K
  (``(S(2), S(1)) -> P``), ``P`` through either operand.
- 3d x 2d: M (``(S(1), R) -> S(0)``), K (``(S(2), S(0)) -> P``), ``P`` through either operand.
- 2d x 2d: M (``(S(0), R) -> S(1)``), N (``(R, S(1)) -> S(2)``), ``P`` through either operand.

Not offered: splitting a dim that ``offs`` cuts (a 2-D operand's grouped dim: a rank's rows would
need offsets of its own, which depend on the routing), and splitting the groups of a 2d x 3d
product (that is expert parallelism: tokens must travel to their expert's rank by all-to-all, a
different program). With a bias, K splits and ``P`` are not offered (the bias would be added once
per rank). ``out_dtype`` does not change the placements.

The kernels want 16-byte-aligned leading strides. Which of an operand's last two dims sets its
leading stride depends on its layout (HF passes expert weights transposed), which the rule does not
see, so ``aligned_pieces`` (the rule's ``LocalCheck``) keeps a split of either of the last two dims
of ``a`` or ``b`` only where the piece's size there is a multiple of 16 bytes. Realistic widths
split many times over; a tiny model's may not, and then that split is simply not offered.

``transformers::grouped_mm_fallback(input, weight, offs)`` (the library's custom op for the 2d x 3d
form, used when ``_grouped_mm`` cannot run, e.g. float32 under ``torch.export``) takes the 2d x 3d
rule; it is keyed by name so that transformers need not be imported.
"""
from __future__ import annotations

import torch

from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = ["grouped_mm_rule", "aligned_pieces"]


def aligned_pieces(call: OpCall, local_inputs: list, local_outputs: list) -> bool:
    """Every split dim among the last two of ``a`` and ``b`` keeps a multiple of 16 bytes per piece."""
    for meta, local in zip(call.inputs[:2], local_inputs[:2]):
        align = max(1, 16 // meta.dtype.itemsize)
        for d in (-2, -1):
            if local[d] != meta.shape[d] and local[d] % align:
                return False
    return True


def _bias_on(ndim_out: int, out_dim, bias_ndim: int):
    """Bias placement when the output is split on ``out_dim`` (None: R); the bias is (G, N) or (N,)."""
    if out_dim == ndim_out - 1:
        return Shard(bias_ndim - 1)
    return R


@register_rule(aten._grouped_mm.default, "transformers::grouped_mm_fallback", float_partials_only=True,
               local_check=aligned_pieces)
def grouped_mm_rule(call: OpCall) -> list[Strategy1D]:
    args = call.bound_args
    a, b = call.inputs[0], call.inputs[1]
    has_offs = args.get("offs") is not None
    has_bias = args.get("bias") is not None
    form = (len(a.shape), len(b.shape))
    # (a, b, out) placements; K splits give P
    table = {
        (2, 3): [((R, Shard(2)), Shard(1)), ((Shard(1), Shard(1)), P)],
        (3, 3): [((Shard(0), Shard(0)), Shard(0)), ((Shard(1), R), Shard(1)), ((R, Shard(2)), Shard(2)),
                 ((Shard(2), Shard(1)), P)],
        (3, 2): [((Shard(1), R), Shard(0)), ((Shard(2), Shard(0)), P)],
        (2, 2): [((Shard(0), R), Shard(1)), ((R, Shard(1)), Shard(2))],
    }.get(form, [])
    out_ndim = len(call.outputs[0].shape)
    found = []
    for (pa, pb), out in table:
        if has_bias and isinstance(out, Partial):
            continue
        ins = [pa, pb] + ([R] if has_offs else [])
        if has_bias:
            bias_ndim = len(call.inputs[-1].shape)
            out_dim = out.dim if isinstance(out, Shard) else None
            if form == (3, 3) and out_dim == 0:
                ins.append(Shard(0) if bias_ndim == 2 else R)
            else:
                ins.append(_bias_on(out_ndim, out_dim, bias_ndim))
        found.append(Strategy1D(tuple(ins), (out,)))
    if not has_bias:
        offs = (R,) if has_offs else ()
        found += [Strategy1D((P, R) + offs, (P,)), Strategy1D((R, P) + offs, (P,))]
    return found
