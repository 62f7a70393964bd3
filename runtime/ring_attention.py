"""Ring attention: scaled dot-product attention with q, k and v split along the sequence over a ring.

Each rank of a communicator (one mesh axis, or several flattened) holds one contiguous chunk of the
query sequence and one of the key/value sequence, in rank order (chunk i on ring index i, as the
placement ``S(seq)`` lays them out). The forward passes the key/value chunks around the ring: at
step t a rank attends its queries to the chunk of ring index ``(i - t) mod n``, while (isend/irecv)
the chunk it holds travels on to ``i + 1``. Partial results are merged by their log-sum-exp
(online softmax), so no rank ever holds more than two key/value chunks.

The backward re-runs the ring: with the final log-sum-exp it recomputes each block's probabilities,
adds to the local dq, and adds the block's dk/dv to accumulators that travel with the chunk; after n
steps each accumulator is back at the chunk's owner.

Causal masks use global positions (query ``L0 + r`` may see key ``S0 + c`` when ``S0 + c <= L0 + r``,
sdpa's top-left alignment). With contiguous chunks the causal work is unbalanced (the last rank
computes n blocks, the first one); the cost model prices the critical path (see
``passes/cost/attention.py``).

Grouped-query attention (``Hq = g * Hkv``, ``enable_gqa``) maps q head h to kv head ``h // g``.
``attn_mask`` (bool: True attends; float: added to the scores) is given for the local queries and
ALL keys (``(..., L/n, S)``); it gets no gradient. Dropout is not supported (the rule never offers
this lowering with ``dropout_p > 0``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import AxisComm

__all__ = ["ring_attention", "RingAttention"]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   is_causal: bool, scale: Optional[float], comm: AxisComm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of this rank's query chunk; output ``(..., Hq, L/n, Ev)``, logsumexp
    ``(..., Hq, L/n)`` in float32 (not differentiable)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(q, k, v, attn_mask, bool(is_causal), float(scale), comm)


class _Ring:
    """Send to ring index i+1, receive from i-1 (global ranks resolved once)."""

    def __init__(self, comm: AxisComm):
        self.comm = comm
        self.n, self.i = comm.size, comm.rank
        if self.n > 1:
            group = comm.pg()
            self.next = dist.get_global_rank(group, (self.i + 1) % self.n)
            self.prev = dist.get_global_rank(group, (self.i - 1) % self.n)
            self.group = group

    def start(self, buf: torch.Tensor):
        """Post the exchange of ``buf``; returns (received buffer, requests)."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(reqs) -> None:
        for r in reqs:
            r.wait()


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, likes: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in likes:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(..., Hq, L, E) -> (..., Hkv, g, L, E)."""
    return q.unflatten(-3, (hkv, q.shape[-3] // hkv))


def _block_scores(qg, kb, mask_blk, causal, q0, k0, scale) -> torch.Tensor:
    """Scores (..., Hkv, g, Lc, Sc) of the grouped queries against one key block, masked."""
    s = torch.matmul(qg, kb.unsqueeze(-3).transpose(-1, -2)) * scale
    if mask_blk is not None:
        m = mask_blk.broadcast_to(s.shape[:-4] + (s.shape[-4] * s.shape[-3],) + s.shape[-2:]).reshape(s.shape)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    if causal:
        rows = torch.arange(q0, q0 + s.shape[-2], device=s.device).unsqueeze(-1)
        cols = torch.arange(k0, k0 + s.shape[-1], device=s.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _mask_cols(mask: Optional[torch.Tensor], k0: int, sc: int) -> Optional[torch.Tensor]:
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask[..., k0:k0 + sc]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, comm):
        ring = _Ring(comm)
        n, i = ring.n, ring.i
        lc, sc, hkv = q.shape[-2], k.shape[-2], k.shape[-3]
        qg = _grouped(q.float(), hkv)
        lse = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
        out = torch.zeros(qg.shape[:-1] + (v.shape[-1],), device=q.device)
        kv = _pack(k, v)
        for t in range(n):
            j = (i - t) % n
            pending = ring.start(kv) if t < n - 1 else None
            kb, vb = (x.float() for x in _unpack(kv, (k, v)))
            s = _block_scores(qg, kb, _mask_cols(mask, j * sc, sc), causal, i * lc, j * sc, scale)
            blk = torch.logsumexp(s, -1)
            new = torch.logaddexp(lse, blk)
            safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            p = torch.exp(s - safe.unsqueeze(-1))
            out = out * torch.exp(lse - safe).unsqueeze(-1) + torch.matmul(p, vb.unsqueeze(-3))
            lse = new
            if pending is not None:
                kv, reqs = pending
                ring.finish(reqs)
        out_q = out.flatten(-4, -3).to(q.dtype)
        lse_q = lse.flatten(-3, -2)
        ctx.save_for_backward(q, k, v, mask, out_q, lse_q)
        ctx.causal, ctx.scale, ctx.comm = causal, scale, comm
        ctx.mark_non_differentiable(lse_q)
        return out_q, lse_q

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        causal, scale = ctx.causal, ctx.scale
        ring = _Ring(ctx.comm)
        n, i = ring.n, ring.i
        lc, sc, hkv = q.shape[-2], k.shape[-2], k.shape[-3]
        qg = _grouped(q.float(), hkv)
        dog = _grouped(dout.float(), hkv)
        lse_g = _grouped(lse.unsqueeze(-1), hkv).squeeze(-1)
        safe = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)
        delta = (dog * _grouped(out.float(), hkv)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qg)
        kf, vf = k.float(), v.float()
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        for t in range(n):
            j = (i - t) % n
            s = _block_scores(qg, kf, _mask_cols(mask, j * sc, sc), causal, i * lc, j * sc, scale)
            p = torch.exp(s - safe.unsqueeze(-1))
            dv = dv + torch.matmul(p.transpose(-1, -2), dog).sum(-3)
            dp = torch.matmul(dog, vf.unsqueeze(-3).transpose(-1, -2))
            ds = p * (dp - delta) * scale
            dq = dq + torch.matmul(ds, kf.unsqueeze(-3))
            dk = dk + torch.matmul(ds.transpose(-1, -2), qg).sum(-3)
            if n == 1:
                break
            if t < n - 1:  # the chunk moves on with its gradient accumulators
                buf, reqs = ring.start(_pack(kf, vf, dk, dv))
                ring.finish(reqs)
                kf, vf, dk, dv = _unpack(buf, (kf, vf, dk, dv))
            else:  # the accumulators go home: chunk (i - n + 1) belongs to ring index i + 1
                buf, reqs = ring.start(_pack(dk, dv))
                ring.finish(reqs)
                dk, dv = _unpack(buf, (dk, dv))
        return (dq.flatten(-4, -3).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None)
