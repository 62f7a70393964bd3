"""The blocks of one ring step computed by torch's fused CPU attention kernel.

``aten._scaled_dot_product_flash_attention_for_cpu`` returns a block's output with its
log-sum-exp, which is all the ring's online-softmax merge needs; its backward, given the GLOBAL
(merged) output and log-sum-exp, returns the block's exact share of dq, dk and dv (the block's
probabilities are ``exp(scores - lse_global)``), so no score matrix is ever held outside the kernel.

The kernel takes 4-d ``(B, H, L, E)`` CPU tensors in float32, bfloat16 or float16, grouped-query
heads as they are, and an additive float mask in the query's dtype. ``block_path`` says whether a
ring can use it; what it cannot take (a float mask that needs a gradient, as T5's learned bias;
other ranks, dtypes or devices; CUDA, untested here) stays on the matmul path in
``ring_attention``. ``USE_FUSED = False`` forces the matmul path (tests compare the two).

An explicit mask (boolean, or float without gradient) takes the fused path only with
``FUSED_MASKS = True``; by default it stays on the matmul path. Why: on the Hugging Face zoo's CLIP
(text tower, boolean causal mask, ring over 2 ranks) the fused path's rounding noise on the token
embedding's gradient measured 7.2e-6 against one device where the matmul path's is 3.8e-6, just over
the zoo's tolerance. The masked fused path meets the ring tests' tolerance (they run it).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

__all__ = ["USE_FUSED", "FUSED_MASKS", "FUSED_DTYPES", "BlockCall", "block_path", "fused_calls", "call_mask",
           "block_forward", "block_backward"]

#: False sends every ring through the matmul path.
USE_FUSED = True
#: True lets rings with an explicit (boolean, or float without gradient) mask take the fused path.
FUSED_MASKS = False
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def block_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> str:
    """``"fused"`` when the fused kernel can compute this ring's blocks, else ``"matmul"``."""
    takes = (USE_FUSED and all(t.device.type == "cpu" and t.dim() == 4 and t.dtype == q.dtype for t in (k, v))
             and q.device.type == "cpu" and q.dim() == 4 and q.dtype in FUSED_DTYPES
             and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[-1] == k.shape[-1] == v.shape[-1]
             and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
             and (mask is None or (FUSED_MASKS and _mask_takes(mask))))
    return "fused" if takes else "matmul"


def _mask_takes(mask: torch.Tensor) -> bool:
    """A mask the kernel can take: at most 4-d, boolean or float without gradient."""
    return mask.dim() <= 4 and (mask.dtype == torch.bool or (mask.is_floating_point() and not mask.requires_grad))


class BlockCall(NamedTuple):
    """One kernel call: local query ``rows`` against local key ``cols``; ``mask_cols`` are the
    same keys' columns in the caller's mask (global positions); ``keep`` an explicit causal
    (rows x cols) boolean where the causal cut is not the block's diagonal."""
    rows: slice
    cols: slice
    mask_cols: slice
    is_causal: bool
    keep: Optional[torch.Tensor]


def fused_calls(q_ranges, k_ranges, causal: bool, has_mask: bool, device) -> list[BlockCall]:
    """The kernel calls covering every (query piece, key piece) some query sees. Ranges are
    ``(local offset, global start, length)``. Wholly visible key pieces next to each other are one
    call; a diagonal piece (same start and length) is a causal call (an explicit mask when the
    caller has a mask too, to merge them); other partly visible pieces get an explicit mask."""
    calls: list[BlockCall] = []
    for r0, qs, ql in q_ranges:
        rows = slice(r0, r0 + ql)
        for c0, ks, kl in k_ranges:
            if causal and ks > qs + ql - 1:
                continue
            cols, mcols = slice(c0, c0 + kl), slice(ks, ks + kl)
            if not causal or ks + kl - 1 <= qs:
                last = calls[-1] if calls else None
                if (last is not None and last.rows == rows and last.keep is None and not last.is_causal
                        and last.cols.stop == c0 and (not has_mask or last.mask_cols.stop == ks)):
                    calls[-1] = last._replace(cols=slice(last.cols.start, c0 + kl),
                                              mask_cols=slice(last.mask_cols.start, ks + kl))
                else:
                    calls.append(BlockCall(rows, cols, mcols, False, None))
            elif ks == qs and kl == ql and not has_mask:
                calls.append(BlockCall(rows, cols, mcols, True, None))
            else:
                keep = (torch.arange(ks, ks + kl, device=device).unsqueeze(0)
                        <= torch.arange(qs, qs + ql, device=device).unsqueeze(-1))
                calls.append(BlockCall(rows, cols, mcols, False, keep))
    merged: list[BlockCall] = []  # query pieces next to each other that see the same whole keys
    for call in calls:
        last = merged[-1] if merged else None
        if (last is not None and last.keep is None and call.keep is None and not last.is_causal
                and not call.is_causal and last.cols == call.cols and last.mask_cols == call.mask_cols
                and last.rows.stop == call.rows.start):
            merged[-1] = last._replace(rows=slice(last.rows.start, call.rows.stop))
        else:
            merged.append(call)
    return merged


def call_mask(mask: Optional[torch.Tensor], call: BlockCall, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The additive float mask (in ``dtype``) of one call: the caller's mask (given for the local
    queries and all keys) cut to the call, plus its explicit causal cut; None when there is none."""
    out = None
    if mask is not None:
        m = mask if mask.shape[-2] == 1 else mask[..., call.rows, :]
        m = m if m.shape[-1] == 1 else m[..., call.mask_cols]
        out = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, -math.inf) \
            if m.dtype == torch.bool else m.to(dtype)
    if call.keep is not None:
        cut = torch.zeros(call.keep.shape, dtype=dtype, device=call.keep.device).masked_fill(~call.keep, -math.inf)
        out = cut if out is None else out + cut
    return out


def block_forward(q, k, v, mask: Optional[torch.Tensor], is_causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, float32 log-sum-exp) of one block; rows the mask hides entirely get log-sum-exp
    -inf (the kernel reports 0 for them, which would count in the merge)."""
    out, lse = _FORWARD(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    if mask is not None:
        lse = lse.masked_fill(~(mask > -math.inf).any(-1), -math.inf)
    return out, lse


def block_backward(dout, q, k, v, out, lse, mask: Optional[torch.Tensor], is_causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's (dq, dk, dv) given the global output and log-sum-exp of its rows (``lse``
    finite: rows no key sees pass 0, their probabilities are 0 anyway)."""
    return _BACKWARD(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
