"""Kernel tables on an accelerator: what real GEMMs, fused attention, copies and the fused AdamW step
achieve, by shape, timed with CUDA events (wall clock on a CPU).

The cost model prices these kernels from a few cited constants (``passes/cost/kernels.py``); these
tables are what one device really does, so a profile can replace the constants and a report can put
predicted next to measured (``benchmarks/gpu_calibration.py``):

- ``time_gemm_table``: rows ``[m, n, k, layout, seconds]`` of bf16 GEMMs; ``layout`` is ``fwd``
  (``F.linear(x, w)``), ``dgrad`` (``g @ w``) or ``wgrad`` (``g.T @ x``), the three a linear layer's
  step multiplies in, each ``m x k @ k x n``;
- ``time_attention_table``: rows ``[batch, heads, seq, head_dim, causal, forward_s, backward_s]`` of
  ``scaled_dot_product_attention`` (the flash kernel where the device has one), the backward alone;
- ``time_copy``: ``[bytes read + written, seconds]`` of a device copy;
- ``time_fused_adamw``: ``[parameters, seconds]`` of ``torch.optim.AdamW(fused=True).step()`` on fp32
  parameters (CUDA only; ``foreach`` elsewhere).

Shapes default to the GEMMs, attention and optimizer of Llama-3 8B / 70B / 405B layers at the
sequence lengths published runs use, plus wave-quantisation and skinny probes.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_GEMM_SHAPES", "DEFAULT_ATTENTION_CASES", "KernelClock", "time_gemm_table",
           "time_attention_table", "time_copy", "time_fused_adamw", "measure_kernel_tables"]

#: (m, n, k): tokens x output features x input features of the linears of Llama-3 8B (d 4096, kv
#: 1024, ffn 14336, vocab 128256) at 2 x 8192 tokens, 70B and 405B layers under TP 8 at 8192 tokens,
#: wave-quantisation probes (132 and 133 tile rows of 128 on a 132-SM H100), squares and skinny shapes.
DEFAULT_GEMM_SHAPES = (
    (16384, 4096, 4096), (16384, 1024, 4096), (16384, 14336, 4096), (16384, 4096, 14336),
    (16384, 128256, 4096), (16384, 6144, 4096),
    (8192, 1280, 8192), (8192, 3584, 8192), (8192, 8192, 1024), (8192, 8192, 3584),
    (8192, 2560, 16384), (8192, 6656, 16384), (8192, 16384, 2048), (8192, 16384, 6656),
    (132 * 128, 1024, 8192), (133 * 128, 1024, 8192),
    (8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (1024, 1024, 1024), (512, 512, 512),
    (256, 4096, 4096), (64, 4096, 4096), (16, 8192, 8192),
)

#: (batch, heads, seq, head_dim, causal): Llama-3 8B attention at 8192 (batch 1 and 2), 70B / 405B
#: heads per rank under TP 8, shorter sequences, and one non-causal case.
DEFAULT_ATTENTION_CASES = (
    (1, 32, 8192, 128, True), (2, 32, 8192, 128, True), (1, 8, 8192, 128, True), (1, 16, 8192, 128, True),
    (1, 32, 4096, 128, True), (4, 32, 2048, 128, True), (4, 32, 2048, 128, False), (1, 32, 8192, 64, True),
)


class KernelClock:
    """Median seconds per call of ``fn`` over ``repeats`` batches, after ``warmup`` calls: CUDA
    events on a GPU (device time, no host gaps counted), ``perf_counter`` on a CPU. A batch holds
    enough calls to last about ``batch_s`` seconds."""

    def __init__(self, device: torch.device, repeats: int = 5, warmup: int = 2, batch_s: float = 0.02):
        self.device, self.repeats, self.warmup, self.batch_s = torch.device(device), repeats, warmup, batch_s

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        once = max(time.perf_counter() - t0, 1e-6)
        calls = int(max(1, min(200, self.batch_s / once)))
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)


def time_gemm_table(clock: KernelClock, shapes: Sequence[tuple], dtype=torch.bfloat16,
                    layouts: Sequence[str] = ("fwd", "dgrad", "wgrad")) -> list:
    """``[m, n, k, layout, seconds]`` per shape and layout (see the module docstring)."""
    dev, rows = clock.device, []
    for m, n, k in shapes:
        for layout in layouts:
            if layout == "fwd":      # x [m, k], weight [n, k]: F.linear
                a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(n, k, device=dev, dtype=dtype)
                fn = (lambda a=a, b=b: F.linear(a, b))
            elif layout == "dgrad":  # grad_out [m, k'] @ weight [k', n]: the input gradient, row-major weight
                a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
                fn = (lambda a=a, b=b: torch.mm(a, b))
            elif layout == "wgrad":  # grad_out.T [m, k'] @ x [k', n]: the weight gradient, both transposed reads
                a, b = torch.randn(k, m, device=dev, dtype=dtype).t(), torch.randn(k, n, device=dev, dtype=dtype)
                fn = (lambda a=a, b=b: torch.mm(a, b))
            else:
                raise ValueError(f"unknown GEMM layout {layout!r}; one of fwd, dgrad, wgrad")
            rows.append([m, n, k, layout, clock(fn)])
            del a, b, fn
    return rows


def _sdpa_backend_context(device: torch.device):
    """The flash kernel on a GPU (what torchtitan and HF's sdpa path run); the default elsewhere."""
    if device.type == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
        except ImportError:
            pass
    import contextlib
    return contextlib.nullcontext()


def time_attention_table(clock: KernelClock, cases: Sequence[tuple], dtype=torch.bfloat16) -> list:
    """``[batch, heads, seq, head_dim, causal, forward_s, backward_s]`` per case (backward alone:
    forward + backward timed together, minus the forward)."""
    dev, rows = clock.device, []
    for b, h, s, d, causal in cases:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=dev, dtype=dtype)
        with _sdpa_backend_context(dev):
            fwd = clock(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

            def fwd_bwd():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), grad)
            both = clock(fwd_bwd)
        rows.append([b, h, s, d, bool(causal), fwd, max(both - fwd, 0.0)])
        del q, k, v, grad
    return rows


def time_copy(clock: KernelClock, sizes: Sequence[int]) -> list:
    """``[bytes read + written, seconds]`` of ``dst.copy_(src)`` between two buffers of half that size."""
    rows = []
    for moved in sizes:
        src = torch.empty(int(moved) // 2, dtype=torch.uint8, device=clock.device).random_()
        dst = torch.empty_like(src)
        rows.append([2 * src.numel(), clock(lambda: dst.copy_(src))])
        del src, dst
    return rows


def time_fused_adamw(clock: KernelClock, sizes: Sequence[int]) -> list:
    """``[parameters, seconds]`` of one AdamW step over fp32 parameters split into 64 tensors (fused
    on CUDA, foreach elsewhere), with gradients and state already allocated."""
    rows = []
    for numel in sizes:
        per = max(1, int(numel) // 64)
        params = [torch.zeros(per, device=clock.device, requires_grad=True) for _ in range(64)]
        for p in params:
            p.grad = torch.randn_like(p)
        fused = clock.device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=None if fused else True)
        opt.step()
        rows.append([per * 64, clock(opt.step)])
        del opt, params
    return rows


def measure_kernel_tables(device: torch.device, *, quick: bool = False,
                          log: Callable[[str], None] = lambda m: None) -> dict:
    """Every table above on ``device`` (small shapes when ``quick``, e.g. on a CPU), as profile sections:
    ``{"gemm_table": {...}, "attention_table": {...}, "copy_table": {...}, "adamw_table": {...}}``."""
    device = torch.device(device)
    clock = KernelClock(device, repeats=3 if quick else 5)
    gemms = ((256, 256, 256), (512, 256, 128), (64, 512, 256)) if quick else DEFAULT_GEMM_SHAPES
    attn = ((1, 2, 128, 32, True), (1, 2, 128, 32, False)) if quick else DEFAULT_ATTENTION_CASES
    copies = (1 << 22, 1 << 24) if quick else (1 << 28, 1 << 30, 1 << 32)
    adamw = (1 << 16,) if quick else (1 << 26, 1 << 28)
    dtype = torch.bfloat16
    out = {}
    t0 = time.perf_counter()
    out["gemm_table"] = {"dtype": "bfloat16", "columns": ["m", "n", "k", "layout", "seconds"],
                         "rows": time_gemm_table(clock, gemms, dtype)}
    log(f"GEMM table: {len(out['gemm_table']['rows'])} rows ({time.perf_counter() - t0:.1f} s)")
    out["attention_table"] = {"dtype": "bfloat16", "kernel": "scaled_dot_product_attention",
                              "columns": ["batch", "heads", "seq", "head_dim", "causal", "forward_s", "backward_s"],
                              "rows": time_attention_table(clock, attn, dtype)}
    log(f"attention table ({time.perf_counter() - t0:.1f} s)")
    out["copy_table"] = {"columns": ["bytes", "seconds"], "rows": time_copy(clock, copies)}
    out["adamw_table"] = {"columns": ["parameters", "seconds"], "rows": time_fused_adamw(clock, adamw)}
    log(f"copy and AdamW tables ({time.perf_counter() - t0:.1f} s)")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["device"] = {"name": props.name, "sm_count": props.multi_processor_count,
                         "memory_bytes": float(props.total_memory), "torch": torch.__version__,
                         "cuda": torch.version.cuda}
    return out
