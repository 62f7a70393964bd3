"""Achievable compute: seconds a real GPU takes for one kernel, by op class and shape.

A datasheet peak is a ceiling no kernel reaches. This module prices what a kernel achieves, from
the hardware's achievable-efficiency fields (``passes/cost/hardware.py``: each preset cites its
sources; a ``Hardware`` without them, such as ``"cpu"`` or a JSON profile, keeps the plain
peak-rate pricing, ``achievable(hw)`` is False):

- **GEMM** ``(batch, M, N, K)``, one model for every shape (no threshold): the output is cut into
  tiles (``TENSOR_CORE_TILES`` for 16-bit operands, ``SIMT_TILES`` for fp32), optionally with K
  split ``s`` ways (``SPLIT_K``); the ``tiles x s`` thread blocks run in ``ceil(blocks / SMs)``
  waves (wave quantisation: a last partial wave costs a whole one), each SM at ``gemm_efficiency``
  of its share of the dense peak. A kernel never beats moving A, B and C once through HBM at the
  achievable bandwidth (roofline: skinny shapes are memory-bound), a split K pays for writing
  and reading back its fp32 partial sums, and the output's write-out is paid after the compute when
  the main loop is too short to hide it (``exposed_write``: small-K batched GEMMs). The cheapest (tile, split) is taken, as a library's
  heuristic would pick among its kernels. Every candidate's time grows with M, N, K and batch, so
  the minimum does too: more rows never cost less, and ``k`` microbatches never cost less than one
  GEMM of all their rows (``ceil(2x) <= 2 ceil(x)``).
- **fused attention** (flash / cuDNN): ``4 b h L S d`` forward FLOPs, halved for causal attention
  without a mask (the kernel skips the masked blocks), at ``attention_efficiency`` of peak; the
  backward recomputes the scores and takes ``attention_backward_factor`` x the forward's time
  (FlashAttention-2, Dao 2023, sec. 3.1: 2.5x the forward's FLOPs; the H100/H200 presets and a
  measured profile set it from their kernels' times).
- **memory-bound ops**: bytes read + written at ``memory_efficiency`` x HBM bandwidth.
- **fused optimizer step**: memory-bound, ``optimizer_bytes_per_param`` per local parameter.
- every kernel lasts at least ``min_kernel_s`` (launch and tail latency of a tiny kernel): the
  functions here apply it per call; the cost model per launch of an op on each rank, after sharding.

>>> from autoshard.passes.cost.hardware import PRESETS
>>> h100 = PRESETS["h100"]
>>> round(gemm_efficiency(h100, 1, 132 * 128, 1024, 8192), 3)  # whole waves of tiles: the measured cap
0.714
>>> round(gemm_efficiency(h100, 1, 8192, 8192, 8192), 3)        # 2048 tiles of 128x256 = 15.5 waves
0.693
>>> round(gemm_efficiency(h100, 1, 133 * 128, 1024, 8192), 3)  # 8 tiles over 8 waves: a ninth wave
0.64
>>> gemm_efficiency(h100, 1, 16, 8192, 8192) < 0.1               # skinny: HBM-bound
True
>>> [round(gemm_seconds(h100, 1, m, 2048, 512, 4) * 1e6, 1) for m in (64, 96, 128, 129)]  # fp32, microseconds
[4.3, 6.8, 7.2, 11.5]
"""
from __future__ import annotations

import functools
import math

__all__ = ["achievable", "TENSOR_CORE_TILES", "SIMT_TILES", "SPLIT_K", "gemm_efficiency", "gemm_seconds",
           "attention_seconds", "memory_seconds", "optimizer_seconds", "ADAMW_BYTES_PER_PARAM"]

#: Output tiles (rows x columns per thread block) of 16-bit tensor-core GEMMs: 256x128, 128x256,
#: 128x128, 256x64 and 64x256 (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001,
#: sec. 2.3 "Typical tile dimensions in cuBLAS", and CUTLASS's kernel generator,
#: python/cutlass_library/generator.py, 16-bit TensorOp tile descriptions). The guide's smaller
#: tiles (128x64, 64x128, 64x64) are left out: it ranks them least efficient (less operand reuse),
#: and at one per-SM rate they would be priced as efficient as the large ones. 64 rows is also the
#: smallest M of one Hopper warpgroup MMA (PTX ISA, ``wgmma.mma_async`` shapes m64nNk16).
TENSOR_CORE_TILES = ((128, 128), (128, 256), (256, 128), (64, 256), (256, 64))
#: fp32 GEMMs (no TF32: PyTorch's default ``allow_tf32=False`` for matmuls) run on the CUDA cores, whose
#: CUTLASS SIMT kernels tile 128x128, 128x64, 64x128, 64x64, 128x32 and 32x128 (generator.py,
#: ``GenerateSM50_Simt``, the SIMT tile descriptions later architectures reuse). All at one per-SM
#: rate: the CUDA cores run at about 1/15 of the tensor cores' rate (H100 datasheet: 67 against 989
#: TFLOPS), so even a small tile is fed; an assumption, no fp32 GEMM has been measured here.
SIMT_TILES = ((128, 128), (128, 64), (64, 128), (64, 64), (128, 32), (32, 128))
#: K split 1..16 ways when the tiles alone leave SMs idle (CUTLASS ``GemmSplitKParallel``: partial
#: products per K slice, then a reduction kernel; cuBLAS picks split-K kernels for small M x N,
#: large K). The set is fixed, not chosen per shape, so the price stays monotone in every dimension.
SPLIT_K = (1, 2, 4, 8, 16)
_ACCUMULATOR_BYTES = 4  # split-K partial sums are fp32 (the accumulator type of both kernel families)

#: AdamW with fp32 master weights, one fused (foreach/fused) kernel pass: read parameter (4), gradient
#: (4), exp_avg (4), exp_avg_sq (4); write parameter (4), exp_avg (4), exp_avg_sq (4) = 28 bytes per
#: parameter (PyTorch's ``torch.optim.AdamW(fused=True)`` updates all four tensors in one pass).
ADAMW_BYTES_PER_PARAM = 28.0


def achievable(hw) -> bool:
    """Does ``hw`` carry the achievable-throughput fields (an SM count)?"""
    return getattr(hw, "sm_count", 0) > 0


def gemm_efficiency(hw, batch: int, m: int, n: int, k: int, itemsize: int = 2) -> float:
    """Fraction of the dense peak one GEMM (``batch`` independent ``m x k @ k x n``) achieves on ``hw``,
    launch overhead aside (``gemm_seconds`` adds it).

    1.0 (peak) when ``hw`` has no achievable-throughput model."""
    if not achievable(hw):
        return 1.0
    m, n, k, batch = max(1, int(m)), max(1, int(n)), max(1, int(k)), max(1, int(batch))
    peak = hw.flops_bf16 if itemsize <= 2 else hw.flops_fp32
    seconds = _tiled_gemm_seconds(peak * hw.gemm_efficiency / hw.sm_count, hw.sm_count,
                                  hw.memory_bandwidth * hw.memory_efficiency, batch, m, n, k, int(itemsize))
    return 2.0 * batch * m * n * k / peak / seconds


@functools.lru_cache(maxsize=1 << 16)
def _tiled_gemm_seconds(sm_flops: float, sms: int, bandwidth: float, batch: int, m: int, n: int, k: int,
                        itemsize: int) -> float:
    """Seconds of the cheapest (tile, K split) for the GEMM on ``sms`` SMs of ``sm_flops`` each: the
    longer of the tiles' compute and reading the operands, plus the output's write-out that the
    compute does not hide (``exposed_write``)."""
    reads = batch * (m * k + k * n) * itemsize / bandwidth
    write = batch * m * n * itemsize / bandwidth
    best = math.inf
    for tm, tn in (TENSOR_CORE_TILES if itemsize <= 2 else SIMT_TILES):
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for split in SPLIT_K:
            waves = math.ceil(tiles * split / sms)
            compute = waves * 2.0 * tm * tn * (k / split) / sm_flops  # every block of a wave: one padded tile
            reduce = 0.0 if split == 1 else 2.0 * split * batch * m * n * _ACCUMULATOR_BYTES / bandwidth
            best = min(best, max(compute, reads) + exposed_write(compute, write) + reduce)
    return best


def exposed_write(compute: float, write: float) -> float:
    """Seconds of a GEMM's output write-out not hidden behind its tiles' compute.

    A thread block computes its tile (the main loop over K), then writes it (the epilogue). With a long
    main loop the epilogues of some blocks run under the main loops of others and cost almost nothing;
    with a short one (a small K: Megatron's unfused attention scores, K = head_dim, write a b x heads x
    s x s output) the epilogue is most of the kernel and is paid after the compute. The H100 probe
    measured that: 384 x (2048 x 96 @ 96 x 2048), the 1.7B row's QK^T, ran in 1.376 ms
    (``benchmarks/gpu_fidelity_probe_h100.json``, "bmm"), 1.19x the roofline of reading and writing
    its operands once and 0.91x compute plus write-out. The exposed part is ``write`` when the compute
    is shorter than it and ``write^2 / compute`` when longer: continuous, non-decreasing in both, and
    ``(head_dim-sized K / K)^2`` of the compute for big GEMMs (0.1% at 8192^3)."""
    if write <= 0.0:
        return 0.0
    return write if compute <= write else write * write / compute


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
