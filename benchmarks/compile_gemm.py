"""What bounds ``compile=True``'s gain on this CPU, measured in CPU time on one thread (no ranks, no gloo):

    python benchmarks/compile_gemm.py            # BENCH_REPS=7

1. The GPT step's matmuls, as one rank of ``compile_step_time.py`` runs them (GPT d 512, 4 blocks,
   vocabulary 2048; a rank's batch 4 x 128 = 512 tokens): each forward (``x @ W.T``), input-gradient
   (``dY @ W``) and weight-gradient (``dY.T @ X``) product of the 512 x 512, 512 x 2048 and
   2048 x 512 layers, run by ATen (MKL's sgemm, what eager and inductor's default both call) and by
   ``torch.compile`` with ``max_autotune`` over inductor's CPP GEMM template and ATen
   (``max_autotune_gemm_backends="CPP,ATEN"``: per product, the choice autotuning timed fastest at
   compile time, which load can mislead; the compiled call's own cost, dynamo's guards and the
   wrapper, tens of microseconds, counts against it), with the achieved GFLOP/s. If the template beat MKL on these shapes, ``CompileOptions(mode=
   "max-autotune-no-cudagraphs")`` would be a compile gain.
2. One rank's forward + backward of that GPT alone (seed 0, the same batch every step), eager and
   ``torch.compile``'d (inductor defaults, as ``compile=True``), interleaved, and the CPU seconds of
   its matmuls alone (the 75 products of the step, from 1.) against the step's: the share fusion
   cannot touch (timed in the same interleaved rounds as the steps).

All times are ``time.thread_time`` (the CPU the thread used, which other processes on a loaded
machine disturb less than the clock), the least of ``BENCH_REPS`` repeats.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autoshard.testing.models import GPT  # noqa: E402

D, HIDDEN, VOCAB, SEQ, LOCAL_BATCH, BLOCKS = 512, 2048, 2048, 128, 4, 4
TOKENS = LOCAL_BATCH * SEQ
REPS = int(os.environ.get("BENCH_REPS", 7))

#: (out_features, in_features) of each linear and how many the step has: q, k, v, o; fc; out; the tied head
LAYERS = (((D, D), 4 * BLOCKS), ((HIDDEN, D), BLOCKS), ((D, HIDDEN), BLOCKS), ((VOCAB, D), 1))


def products(out_f: int, in_f: int) -> list:
    """(name, operand shapes, function) of a linear's three products over ``TOKENS`` rows."""
    return [("x @ W.T", ((TOKENS, in_f), (out_f, in_f)), lambda x, w: x @ w.t()),
            ("dY @ W", ((TOKENS, out_f), (out_f, in_f)), lambda g, w: g @ w),
            ("dY.T @ X", ((TOKENS, out_f), (TOKENS, in_f)), lambda g, x: g.t() @ x)]


def cpu_seconds(fn, *args, inner: int = 4) -> float:
    best = float("inf")
    for _ in range(REPS):
        started = time.thread_time()
        for _ in range(inner):
            fn(*args)
        best = min(best, (time.thread_time() - started) / inner)
    return best


def gemms() -> list:
    """Print ATen against inductor's max-autotune per product; return the step's products as
    (count, function, operands) for ATen."""
    import torch._inductor.config as inductor_config
    step_total, template_total, calls = 0.0, 0.0, []
    print(f"{'product (one rank, 512 tokens)':34s} {'ATen ms':>8s} {'GFLOP/s':>8s} {'autotuned ms':>13s} {'GFLOP/s':>8s}"
          f" {'ratio':>6s}")
    with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
        for (out_f, in_f), count in LAYERS:
            for name, shapes, fn in products(out_f, in_f):
                args = [torch.randn(s) for s in shapes]
                tuned = torch.compile(fn, dynamic=False)
                tuned(*args)
                aten, template = cpu_seconds(fn, *args), cpu_seconds(tuned, *args)
                flops = 2 * TOKENS * out_f * in_f
                step_total += count * aten
                calls.append((count, fn, args))
                template_total += count * template
                print(f"  {name:10s} W {out_f} x {in_f} (x{count:2d})     {aten * 1e3:8.2f} {flops / aten / 1e9:8.0f}"
                      f" {template * 1e3:13.2f} {flops / template / 1e9:8.0f} {template / aten:6.3f}")
    print(f"  the step's matmuls: ATen {step_total * 1e3:.0f} ms, max-autotune {template_total * 1e3:.0f} ms "
          f"({template_total / step_total:.3f})")
    return calls


def step_cpu(calls: list) -> None:
    torch.manual_seed(0)
    model = GPT(VOCAB, D, BLOCKS, 8, SEQ)
    ids, target = torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ)), torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ))
    compiled = torch.compile(model)

    def step(fn):
        logits = fn(ids)
        F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)).backward()
        for p in model.parameters():
            p.grad = None

    for fn in (model, compiled, model, compiled):  # compiles and warms up
        step(fn)
    def matmuls_alone(_):
        for count, fn, args in calls:
            for _ in range(count):
                fn(*args)

    best = {"eager": float("inf"), "compiled": float("inf"), "matmuls": float("inf")}
    for _ in range(REPS):  # interleaved, so load changes hit all three alike
        for label, run, fn in (("eager", step, model), ("compiled", step, compiled), ("matmuls", matmuls_alone, None)):
            started = time.thread_time()
            run(fn)
            best[label] = min(best[label], time.thread_time() - started)
    e, c, matmuls = best["eager"], best["compiled"], best["matmuls"]
    print(f"one rank's forward + backward (batch {LOCAL_BATCH} x {SEQ}), CPU ms: eager {e * 1e3:.0f}, compiled "
          f"{c * 1e3:.0f}, compiled / eager {c / e:.3f}")
    print(f"  its matmuls alone: {matmuls * 1e3:.0f} ms = {100 * matmuls / e:.0f}% of eager's step; the rest, "
          f"{(e - matmuls) * 1e3:.0f} ms, is all fusion could remove: compiled / eager >= {matmuls / e:.3f} "
          "for forward + backward, before the optimizer and the gradient sync")


def main() -> None:
    torch.set_num_threads(1)
    step_cpu(gemms())


if __name__ == "__main__":
    main()
