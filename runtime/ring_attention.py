"""Ring attention: scaled dot-product attention with q, k and v split along the sequence over a ring.

Each rank of a communicator (one mesh axis, or several flattened) holds one contiguous chunk of the
query sequence and one of the key/value sequence, in rank order (chunk i on ring index i, as the
placement ``S(seq)`` lays them out). The forward passes the key/value chunks around the ring: at
step t a rank attends its queries to the chunk of ring index ``(i - t) mod n``, while (isend/irecv)
the chunk it holds travels on to ``i + 1``. Partial results are merged by their log-sum-exp
(online softmax), so no rank ever holds more than two key/value chunks.

The backward re-runs the ring: with the final log-sum-exp it recomputes each block's probabilities,
adds to the local dq, and adds the block's dk/dv to accumulators that travel with the chunk (the
chunk's own pass overlaps the block's compute; the accumulators' pass waits for it); after n
steps each accumulator is back at the chunk's owner.

Causal attention masks by global position (query ``p`` may see key ``c`` when ``c <= p``, sdpa's
top-left alignment) and skips the pieces of a block no query sees. With contiguous chunks that
leaves the work unbalanced (ring index n-1 computes n blocks, index 0 one), so causal
self-attention without an explicit mask runs *zig-zag* (``layout="zigzag"``): each chunk is cut in
two halves, 2n halves in all, and ring index r works on halves r and 2n-1-r, so every rank computes
the same amount at every step. The permutation happens inside the call (``to_zigzag``: one p2p
exchange of q, k and v halves before the ring, the inverse for the output after, and their adjoints
in the backward), so everything outside attention keeps the contiguous ``S(seq)`` layout. Its cost is
about one ring step's traffic for q, k and v, and one for the output.

Which kernel computes the blocks (``ring_blocks.block_path``): on CPU, 4-d float32/bfloat16/float16
q, k, v without a mask (with a boolean mask or a float mask without gradient too when
``ring_blocks.FUSED_MASKS``; off by default, see there) run torch's fused attention kernel per
block (``ring_blocks``: it returns the block's log-sum-exp, and its backward takes the merged output
and log-sum-exp), one call per visible piece: whole pieces, the causal diagonal as a causal call,
any other causal cut as an explicit mask. Everything else (a float mask that needs a gradient, as
T5's learned bias; by default any mask; CUDA; other ranks or dtypes) runs the matmul path: each
block in float32 with plain matmuls, its query rows tiled so that the transient score matrix of a
piece stays under ``TILE_BYTES``. Either way the backward keeps only q, k, v, the mask, the output
and the log-sum-exp.

Grouped-query attention (``Hq = g * Hkv``, ``enable_gqa``) maps q head h to kv head ``h // g``.
``attn_mask`` (bool: True attends; float: added to the scores) is given for the local queries and
ALL keys (``(..., L/n, S)``); a float mask that needs a gradient (a learned position bias, as T5's)
gets it: the score gradient of each block, summed over the dims the mask broadcasts. Dropout is not
supported (the rule never offers this lowering with ``dropout_p > 0``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import AxisComm
from .ring_blocks import block_backward, block_forward, block_path, call_mask, fused_calls

__all__ = ["ring_attention", "RingAttention", "to_zigzag", "from_zigzag"]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                   is_causal: bool, scale: Optional[float], comm: AxisComm,
                   layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of this rank's contiguous query chunk; output ``(..., Hq, L/n, Ev)``,
    logsumexp ``(..., Hq, L/n)`` in float32, or float64 for float64 inputs (not differentiable). ``layout="zigzag"`` needs causal
    self-attention without ``attn_mask`` (see ``passes.sharding.rules.attention.ring_layout``)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fused = block_path(q, k, v, attn_mask) == "fused"
    if layout == "contiguous":
        return RingAttention.apply(q, k, v, attn_mask, bool(is_causal), float(scale), comm, False, fused)
    if layout != "zigzag" or attn_mask is not None or not is_causal:
        raise ValueError(f"ring attention layout {layout!r} needs causal attention without attn_mask")
    q, k, v = (to_zigzag(t, comm) for t in (q, k, v))
    out, lse = RingAttention.apply(q, k, v, None, True, float(scale), comm, True, fused)
    with torch.no_grad():
        lse = _permute(lse.unsqueeze(-1), comm, False).squeeze(-1)
    return from_zigzag(out, comm), lse


# ---- the zig-zag permutation of sequence halves ---------------------------------------------------

def _owner(h: int, n: int, zigzag: bool) -> tuple[int, int]:
    """(ring index, slot 0/1) holding sequence half ``h`` of 2n."""
    if not zigzag:
        return h // 2, h % 2
    return (h, 0) if h < n else (2 * n - 1 - h, 1)


def _halves(i: int, n: int, zigzag: bool) -> tuple[int, int]:
    return (i, 2 * n - 1 - i) if zigzag else (2 * i, 2 * i + 1)


def _permute(x: torch.Tensor, comm: AxisComm, to_zz: bool) -> torch.Tensor:
    """Move the two halves (along dim -2) of this rank's chunk from one layout to the other."""
    n, i = comm.size, comm.rank
    if n == 1:
        return x
    group = comm.pg()
    mine = list(x.chunk(2, dim=-2))
    out = [mine[0].new_empty(mine[0].shape) for _ in range(2)]  # contiguous, whatever x's strides
    ops = []
    for slot, h in enumerate(_halves(i, n, not to_zz)):
        dst, dslot = _owner(h, n, to_zz)
        if dst == i:
            out[dslot].copy_(mine[slot])
        else:
            ops.append(dist.P2POp(dist.isend, mine[slot].contiguous(), dist.get_global_rank(group, dst), group,
                                  tag=h))
    for slot, h in enumerate(_halves(i, n, to_zz)):
        src, _ = _owner(h, n, not to_zz)
        if src != i:
            ops.append(dist.P2POp(dist.irecv, out[slot], dist.get_global_rank(group, src), group, tag=h))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return torch.cat(out, dim=-2)


class _ZigZag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, to_zz):
        ctx.comm, ctx.to_zz = comm, to_zz
        return _permute(x, comm, to_zz)

    @staticmethod
    def backward(ctx, grad):
        return _permute(grad.contiguous(), ctx.comm, not ctx.to_zz), None, None


def to_zigzag(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    """Contiguous chunk i (halves 2i, 2i+1 along dim -2) -> zig-zag chunk (halves i, 2n-1-i)."""
    return _ZigZag.apply(x, comm, True)


def from_zigzag(x: torch.Tensor, comm: AxisComm) -> torch.Tensor:
    return _ZigZag.apply(x, comm, False)


# ---- the ring -----------------------------------------------------------------------------------

class _Ring:
    """Send to ring index i+1, receive from i-1 (global ranks resolved once)."""

    def __init__(self, comm: AxisComm):
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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the matmul path computes scores and accumulates in: float32 for half types, the input's
    own dtype when it is wider (a float64 model stays float64 rather than losing precision here)."""
    return torch.promote_types(dtype, torch.float32)


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


def _ranges(j: int, n: int, length: int, zigzag: bool) -> list[tuple[int, int, int]]:
    """(local offset, global start, length) of the sequence pieces ring index j holds."""
    if not zigzag:
        return [(0, j * length, length)]
    h = length // 2
    return [(0, j * h, h), (h, (2 * n - 1 - j) * h, h)]


#: Most bytes of float32 scores one piece may hold: query rows are tiled so that a block's
#: transient (rows x key chunk) score matrix stays under it, whatever the sequence length.
TILE_BYTES = 2 ** 30


def _tiles(q_ranges, q: torch.Tensor, kv_len: int) -> list[tuple[int, int, int]]:
    """``q_ranges`` cut into tiles of at most ``TILE_BYTES`` of scores against a ``kv_len`` key chunk."""
    per_row = 4 * math.prod(q.shape[:-2]) * kv_len
    step = max(1, TILE_BYTES // max(1, per_row))
    return [(r0 + a, qs + a, min(step, ql - a)) for r0, qs, ql in q_ranges for a in range(0, ql, step)]


class _Blocks:
    """The pieces of one (query chunk, key chunk) pair that some query sees: per query piece, the
    key columns (local indices) to attend to and whether a causal mask is still needed."""

    def __init__(self, q_ranges, k_ranges, causal: bool, device):
        self.pieces = []
        for r0, qs, ql in q_ranges:
            cols = [(c0, ks, kl) for c0, ks, kl in k_ranges if not (causal and ks > qs + ql - 1)]
            if not cols:
                continue
            partial = causal and any(ks + kl - 1 > qs for _, ks, kl in cols)
            idx = torch.cat([torch.arange(c0, c0 + kl, device=device) for c0, _, kl in cols])
            kpos = torch.cat([torch.arange(ks, ks + kl, device=device) for _, ks, kl in cols])
            keep = None
            if partial:
                keep = kpos.unsqueeze(0) <= torch.arange(qs, qs + ql, device=device).unsqueeze(-1)
            whole = len(cols) == len(k_ranges)
            self.pieces.append((slice(r0, r0 + ql), None if whole else idx, keep))


def _scores(qg, kb, mask_rows, keep, scale) -> torch.Tensor:
    """Scores (..., Hkv, g, rows, cols) of grouped queries against (selected) keys, masked."""
    s = torch.matmul(qg, kb.unsqueeze(-3).transpose(-1, -2)) * scale
    if mask_rows is not None:
        m = mask_rows.broadcast_to(s.shape[:-4] + (s.shape[-4] * s.shape[-3],) + s.shape[-2:]).reshape(s.shape)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _mask_block(mask: Optional[torch.Tensor], rows: slice, k0: int, sc: int) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    m = mask if mask.shape[-2] == 1 else mask[..., rows, :]
    return m if m.shape[-1] == 1 else m[..., k0:k0 + sc]


def _cols(x: torch.Tensor, idx) -> torch.Tensor:
    return x if idx is None else x.index_select(-2, idx)


def _fused_forward(q, k, v, mask, causal, scale, ring, zigzag):
    """The ring's forward with each block through the fused kernel: (output, float32 lse)."""
    n, i = ring.n, ring.i
    lc, sc = q.shape[-2], k.shape[-2]
    q_ranges = _ranges(i, n, lc, zigzag)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), device=q.device)
    kv = _pack(k, v)
    for t in range(n):
        j = (i - t) % n
        pending = ring.start(kv) if t < n - 1 else None
        kb, vb = _unpack(kv, (k, v))
        for call in fused_calls(q_ranges, _ranges(j, n, sc, zigzag), causal, mask is not None, q.device):
            rows = call.rows
            block_out, block_lse = block_forward(q[..., rows, :], kb[..., call.cols, :], vb[..., call.cols, :],
                                                 call_mask(mask, call, q.dtype), call.is_causal, scale)
            old = lse[..., rows]
            new = torch.logaddexp(old, block_lse)
            safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            out[..., rows, :] = (out[..., rows, :] * torch.exp(old - safe).unsqueeze(-1)
                                 + block_out.float() * torch.exp(block_lse - safe).unsqueeze(-1))
            lse[..., rows] = new
        if pending is not None:
            kv, reqs = pending
            ring.finish(reqs)
    return out.to(q.dtype), lse


def _fused_backward(dout, q, k, v, mask, out, lse, causal, scale, ring, zigzag):
    """The ring's backward with each block's gradients from the fused kernel: (dq, dk, dv)."""
    n, i = ring.n, ring.i
    lc, sc = q.shape[-2], k.shape[-2]
    q_ranges = _ranges(i, n, lc, zigzag)
    dout = dout.to(q.dtype)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    kb, vb = k, v
    for t in range(n):
        j = (i - t) % n
        kv_pending = ring.start(_pack(kb, vb)) if t < n - 1 else None
        for call in fused_calls(q_ranges, _ranges(j, n, sc, zigzag), causal, mask is not None, q.device):
            rows, cols = call.rows, call.cols
            gq, gk, gv = block_backward(dout[..., rows, :], q[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                        out[..., rows, :], safe[..., rows], call_mask(mask, call, q.dtype),
                                        call.is_causal, scale)
            dq[..., rows, :] += gq
            dk[..., cols, :] += gk
            dv[..., cols, :] += gv
        if n == 1:
            break
        buf, reqs = ring.start(_pack(dk, dv))  # the accumulators follow the chunk, as in the matmul path
        ring.finish(reqs)
        dk, dv = _unpack(buf, (dk, dv))
        if kv_pending is not None:
            kv_buf, kv_reqs = kv_pending
            ring.finish(kv_reqs)
            kb, vb = _unpack(kv_buf, (kb, vb))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, comm, zigzag, fused=False):
        ctx.fused = fused
        if fused:
            out_q, lse_q = _fused_forward(q, k, v, mask, causal, scale, _Ring(comm), zigzag)
            ctx.save_for_backward(q, k, v, mask, out_q, lse_q)
            ctx.causal, ctx.scale, ctx.comm, ctx.zigzag = causal, scale, comm, zigzag
            ctx.mark_non_differentiable(lse_q)
            return out_q, lse_q
        ring = _Ring(comm)
        n, i = ring.n, ring.i
        lc, sc, hkv = q.shape[-2], k.shape[-2], k.shape[-3]
        q_ranges = _tiles(_ranges(i, n, lc, zigzag), q, sc)
        acc = accumulation_dtype(q.dtype)
        qg = _grouped(q.to(acc), hkv)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        out = torch.zeros(qg.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device)
        kv = _pack(k, v)
        for t in range(n):
            j = (i - t) % n
            pending = ring.start(kv) if t < n - 1 else None
            kb, vb = (x.to(acc) for x in _unpack(kv, (k, v)))
            for rows, idx, keep in _Blocks(q_ranges, _ranges(j, n, sc, zigzag), causal, q.device).pieces:
                s = _scores(qg[..., rows, :], _cols(kb, idx), _mask_block(mask, rows, j * sc, sc), keep, scale)
                old = lse[..., rows]
                new = torch.logaddexp(old, torch.logsumexp(s, -1))
                safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
                p = torch.exp(s - safe.unsqueeze(-1))
                out[..., rows, :] = (out[..., rows, :] * torch.exp(old - safe).unsqueeze(-1)
                                     + torch.matmul(p, _cols(vb, idx).unsqueeze(-3)))
                lse[..., rows] = new
            if pending is not None:
                kv, reqs = pending
                ring.finish(reqs)
        out_q = out.flatten(-4, -3).to(q.dtype)
        lse_q = lse.flatten(-3, -2)
        ctx.save_for_backward(q, k, v, mask, out_q, lse_q)
        ctx.causal, ctx.scale, ctx.comm, ctx.zigzag = causal, scale, comm, zigzag
        ctx.mark_non_differentiable(lse_q)
        return out_q, lse_q

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        causal, scale, zigzag = ctx.causal, ctx.scale, ctx.zigzag
        ring = _Ring(ctx.comm)
        if ctx.fused:
            dq, dk, dv = _fused_backward(dout, q, k, v, mask, out, lse, causal, scale, ring, zigzag)
            return dq, dk, dv, None, None, None, None, None, None
        n, i = ring.n, ring.i
        lc, sc, hkv = q.shape[-2], k.shape[-2], k.shape[-3]
        q_ranges = _tiles(_ranges(i, n, lc, zigzag), q, sc)
        acc = accumulation_dtype(q.dtype)
        qg = _grouped(q.to(acc), hkv)
        dog = _grouped(dout.to(acc), hkv)
        lse_g = _grouped(lse.to(acc).unsqueeze(-1), hkv).squeeze(-1)
        safe = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)
        delta = (dog * _grouped(out.to(acc), hkv)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qg)
        kf, vf = k.to(acc), v.to(acc)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        dmask = torch.zeros(mask.shape, dtype=acc, device=q.device) if ctx.needs_input_grad[3] else None
        for t in range(n):
            j = (i - t) % n
            kv_pending = ring.start(_pack(kf, vf)) if t < n - 1 else None  # the chunk moves on during the block
            for rows, idx, keep in _Blocks(q_ranges, _ranges(j, n, sc, zigzag), causal, q.device).pieces:
                kb, vb = _cols(kf, idx), _cols(vf, idx)
                s = _scores(qg[..., rows, :], kb, _mask_block(mask, rows, j * sc, sc), keep, scale)
                p = torch.exp(s - safe[..., rows].unsqueeze(-1))
                do = dog[..., rows, :]
                dvb = torch.matmul(p.transpose(-1, -2), do).sum(-3)
                ds = p * (torch.matmul(do, vb.unsqueeze(-3).transpose(-1, -2)) - delta[..., rows, :]) * scale
                dq[..., rows, :] += torch.matmul(ds, kb.unsqueeze(-3))
                if dmask is not None:  # d(scores) before scaling; contiguous layout: idx is None
                    _add_mask_grad(dmask, (ds / scale).flatten(-4, -3), rows, j * sc, sc)
                dkb = torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(-3)
                if idx is None:
                    dk, dv = dk + dkb, dv + dvb
                else:
                    dk, dv = dk.index_add(-2, idx, dkb), dv.index_add(-2, idx, dvb)
            if n == 1:
                break
            # the accumulators follow the chunk; after the last step they go home (chunk i - n + 1
            # belongs to ring index i + 1)
            buf, reqs = ring.start(_pack(dk, dv))
            ring.finish(reqs)
            dk, dv = _unpack(buf, (dk, dv))
            if kv_pending is not None:
                kv_buf, kv_reqs = kv_pending
                ring.finish(kv_reqs)
                kf, vf = _unpack(kv_buf, (kf, vf))
        dmask = None if dmask is None else dmask.to(mask.dtype)
        return (dq.flatten(-4, -3).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None, None, None, None,
                None)


def _add_mask_grad(dmask: torch.Tensor, dscores: torch.Tensor, rows: slice, k0: int, sc: int) -> None:
    """Add one block's score gradient (..., Hq, rows, cols) into the (broadcast) float mask's gradient."""
    lead = dscores.dim() - dmask.dim()
    g = dscores.sum(dim=tuple(range(lead))) if lead > 0 else dscores
    dims = tuple(d for d in range(g.dim() - 2) if dmask.shape[d] == 1 and g.shape[d] != 1)
    g = g.sum(dim=dims, keepdim=True) if dims else g
    r = rows if dmask.shape[-2] != 1 else slice(None)
    if dmask.shape[-2] == 1:
        g = g.sum(-2, keepdim=True)
    if dmask.shape[-1] == 1:
        dmask[..., r, :] += g.sum(-1, keepdim=True)
    else:
        dmask[..., r, k0:k0 + sc] += g
