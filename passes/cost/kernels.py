"""Achievable compute: seconds a real GPU takes for one kernel, by op class and shape.

A datasheet peak is a ceiling no kernel reaches. This module prices what a kernel achieves, from
the hardware's achievable-efficiency fields (``passes/cost/hardware.py``: each preset cites its
sources; a ``Hardware`` without them, such as ``"cpu"`` or a JSON profile, keeps the plain
peak-rate pricing, ``achievable(hw)`` is False):

- **GEMM** ``(batch, M, N, K)``: output tiles of ``TILES`` (cuBLAS/CUTLASS pick a tile per shape;
  the cheapest of the candidates is taken, as a heuristic would), ``ceil(tiles / SMs)`` waves
  (wave quantisation: a last partial wave costs a whole one), at ``gemm_efficiency`` of the dense
  peak (the maximum achievable matmul FLOP/s, measured), and never faster than moving its operands
  and result once through HBM at the achievable bandwidth (roofline: skinny shapes are memory-bound).
- **fused attention** (flash / cuDNN): ``4 b h L S d`` forward FLOPs, halved for causal attention
  without a mask (the kernel skips the masked blocks), at ``attention_efficiency`` of peak; the
  backward recomputes the scores and does 2.5x the forward's FLOPs (FlashAttention-2, Dao 2023, sec. 3.1;
  ``attention_backward_factor``: a measured profile sets it from its own kernel's times).
- **memory-bound ops**: bytes read + written at ``memory_efficiency`` x HBM bandwidth.
- **fused optimizer step**: memory-bound, ``optimizer_bytes_per_param`` per local parameter.
- every kernel lasts at least ``min_kernel_s`` (launch and tail latency of a tiny kernel): the
  functions here apply it per call; the cost model per launch of an op on each rank, after sharding.

>>> from autoshard.passes.cost.hardware import PRESETS
>>> h100 = PRESETS["h100"]
>>> round(gemm_efficiency(h100, 1, 132 * 128, 1024, 8192), 3)  # whole waves of tiles: the measured cap
0.715
>>> round(gemm_efficiency(h100, 1, 8192, 8192, 8192), 3)        # 2048 tiles of 128x256 = 15.5 waves
0.693
>>> round(gemm_efficiency(h100, 1, 133 * 128, 1024, 8192), 3)  # 8 tiles over 8 waves: a ninth wave
0.64
>>> gemm_efficiency(h100, 1, 16, 8192, 8192) < 0.1               # skinny: HBM-bound
True
"""
from __future__ import annotations

import math

__all__ = ["achievable", "TILES", "gemm_efficiency", "gemm_seconds", "attention_seconds", "memory_seconds",
           "optimizer_seconds", "ADAMW_BYTES_PER_PARAM"]

#: Output tile shapes (rows x columns) cuBLAS / CUTLASS use for large 16-bit tensor-core GEMMs on
#: Ampere and Hopper: 128x128, 128x256 and 256x128 (CUTLASS docs, "Efficient GEMM in CUDA":
#: threadblock tile sizes; cuBLAS heuristics pick among such tiles per shape). A shape narrower than
#: ``SKINNY`` in M or N is not tiled that way (cuBLAS dispatches GEMV-like and split-K kernels): it
#: is priced by the roofline alone, at the cap or the achievable HBM bandwidth.
TILES = ((128, 128), (128, 256), (256, 128))
SKINNY = 128

#: AdamW with fp32 master weights, one fused (foreach/fused) kernel pass: read parameter (4), gradient
#: (4), exp_avg (4), exp_avg_sq (4); write parameter (4), exp_avg (4), exp_avg_sq (4) = 28 bytes per
#: parameter (PyTorch's ``torch.optim.AdamW(fused=True)`` updates all four tensors in one pass).
ADAMW_BYTES_PER_PARAM = 28.0


def achievable(hw) -> bool:
    """Does ``hw`` carry the achievable-throughput fields (an SM count)?"""
    return getattr(hw, "sm_count", 0) > 0


def gemm_efficiency(hw, batch: int, m: int, n: int, k: int, itemsize: int = 2) -> float:
    """Fraction of the dense peak one GEMM (``batch`` independent ``m x k @ k x n``) achieves on ``hw``.

    1.0 (peak) when ``hw`` has no achievable-throughput model."""
    if not achievable(hw):
        return 1.0
    m, n, k, batch = max(1, int(m)), max(1, int(n)), max(1, int(k)), max(1, int(batch))
    flops = 2.0 * batch * m * n * k
    peak = hw.flops_bf16 if itemsize <= 2 else hw.flops_fp32
    if min(m, n) < SKINNY:
        compute = flops / (peak * hw.gemm_efficiency)
    else:
        compute = math.inf
        for tm, tn in TILES:
            tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
            waves = math.ceil(tiles / hw.sm_count)
            # each wave runs every SM over a full tile of work: what the padded shape costs
            compute = min(compute, waves * hw.sm_count * tm * tn * k * 2.0 / (peak * hw.gemm_efficiency))
    moved = (batch * (m * k + k * n + m * n)) * itemsize
    seconds = max(compute, moved / (hw.memory_bandwidth * hw.memory_efficiency))
    return flops / peak / seconds


def gemm_seconds(hw, batch: int, m: int, n: int, k: int, itemsize: int = 2) -> float:
    """Seconds of one GEMM on ``hw`` (at least ``min_kernel_s``)."""
    peak = hw.flops_bf16 if itemsize <= 2 else hw.flops_fp32
    flops = 2.0 * batch * m * n * k
    return max(flops / (peak * gemm_efficiency(hw, batch, m, n, k, itemsize)), getattr(hw, "min_kernel_s", 0.0))


def attention_seconds(hw, batch_heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool,
                      backward: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention over ``batch_heads`` (batch x heads) rows."""
    flops = 4.0 * batch_heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    eff = hw.attention_efficiency if achievable(hw) else 1.0
    fwd = max(flops / (hw.flops_bf16 * eff), getattr(hw, "min_kernel_s", 0.0))
    return fwd, (getattr(hw, "attention_backward_factor", 2.5) * fwd if backward else 0.0)


def memory_seconds(hw, nbytes: float) -> float:
    """Seconds of a memory-bound kernel moving ``nbytes`` (read + written)."""
    eff = hw.memory_efficiency if achievable(hw) else 1.0
    return max(nbytes / (hw.memory_bandwidth * eff), getattr(hw, "min_kernel_s", 0.0))


def optimizer_seconds(hw, local_params: float, bytes_per_param: float = ADAMW_BYTES_PER_PARAM) -> float:
    """Seconds of a fused optimizer step over ``local_params`` parameters (memory-bound)."""
    return memory_seconds(hw, local_params * bytes_per_param)
