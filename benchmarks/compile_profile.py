"""Where a step of autoshard eager and autoshard compiled spends its CPU time, side by side: what bounds
``compile=True``'s gain (``benchmarks/compile_step_time.py`` measures the ratio itself).

    torchrun --nproc_per_node 4 benchmarks/compile_profile.py        # BENCH_MODEL=gpt|llama, BENCH_ROUNDS=3

The model, batch, mesh (4,), plan (the solver's for ``hardware="cpu"``) and AdamW step are
``compile_step_time.py``'s. After two warm-up steps (the compiles) and ``BENCH_ROUNDS`` interleaved
rounds of 2 timed steps each, rank 0 profiles one step of each contender with ``torch.profiler`` and
prints the share of the profiled self CPU time of the step's thread per category (gloo's worker threads,
which copy and reduce the buffers beside the step, are summed apart):

- matmul: ``aten::mm``/``addmm``/``bmm`` (the same oneDNN/MKL kernels eager and compiled);
- attention: ``scaled_dot_product`` kernels (a fallback kernel under inductor as well);
- gradient sync: everything inside autograd's ``AccumulateGrad`` (the sync hooks: gradients copied into
  the all-reduce / reduce-scatter buckets, collective launches, the wait for the bucket before) and the
  collectives (``c10d::``, ``_AllReduce``, ``wait_tensor``);
- other copies: ``aten::copy_`` outside those hooks (ZeRO's gather after the optimizer, ``.contiguous()``
  of activations, casts);
- optimizer: the ``Optimizer.step`` ops (``_foreach_``/``lerp_``/``addcdiv_``/...);
- compiled graphs: inductor's fused kernels (self time of ``Call CompiledFxGraph``);
- other: everything else (eager elementwise ops, views, Python glue).

Only "other" and part of "compiled graphs" is what fusing can shrink; matmuls and the eager gradient
sync are the same work in both. The medians of the timed rounds are printed too (a loaded machine
moves them a lot: read them as a rough ratio, ``compile_step_time.py`` for the measured one).

The profiler's times are the clock's: on a loaded machine a rank descheduled inside a kernel or
waiting for a bucket counts that time too. So the script also prints CPU time, the work the cores
did, per step and averaged over the ranks (medians of the timed rounds):

- step thread: ``time.thread_time`` of the thread running the step (compute, hooks, copies, waits
  cost nothing while blocked);
- gloo's threads: the process's CPU time (``time.process_time``) minus the step thread's: the
  collectives' buffer copies and reductions;
- matmuls alone: every ``aten::mm``/``addmm``/``bmm`` of the profiled eager step (shapes from
  ``record_shapes``) run again alone on contiguous operands of those shapes, on the same thread
  (``thread_time``, the least of 3 repeats). Compiled regions call the same kernels (inductor's CPP
  GEMM templates are not faster here: ``compile_gemm.py``), so a compiled step cannot do less than
  these plus gloo's threads; ``floor`` is that sum over eager's process CPU, the best compiled / eager
  any fusion could reach on this machine with this plan.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import autoshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_step_time import BATCH, SEQ, VOCAB, build, lm_loss  # noqa: E402

CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("scaled_dot_product",)),
    ("gradient sync", ("AccumulateGrad", "c10d::", "_AllReduce", "wait_tensor", "all_reduce")),
    ("other copies", ("aten::copy_",)),
    ("optimizer", ("Optimizer.step", "_foreach_", "lerp_", "addcdiv_", "addcmul_", "aten::sqrt", "aten::div",
                   "_local_scalar_dense")),
    ("compiled graphs", ("CompiledFxGraph",)),
)


def category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def _in_hook(event) -> bool:
    """Whether ``event`` ran inside autograd's gradient accumulation (the sync hooks: bucket copies,
    collective launches, waits for the bucket before)."""
    parent = event.cpu_parent
    while parent is not None:
        if "AccumulateGrad" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def shares(prof) -> Counter:
    """Self CPU time by category on the step's thread (the one with the most self time); the time of
    the other threads (gloo's workers copying and reducing buffers beside the step) as "background"."""
    per_thread = Counter()
    events = prof.events()
    for event in events:
        per_thread[event.thread] += event.self_cpu_time_total
    main = per_thread.most_common(1)[0][0]
    out = Counter()
    for event in events:
        if event.thread != main:
            out["background"] += event.self_cpu_time_total
        elif _in_hook(event) or "AccumulateGrad" in event.name:
            out["gradient sync"] += event.self_cpu_time_total
        else:
            out[category(event.name)] += event.self_cpu_time_total
    return out


def matmul_seconds(prof) -> float:
    """CPU seconds (``thread_time``) of the profiled step's matmuls run again alone, on the step's
    thread, operands contiguous and of the recorded shapes; the least of 3 repeats."""
    calls = []
    main = Counter()
    for event in prof.events():
        main[event.thread] += event.self_cpu_time_total
    thread = main.most_common(1)[0][0]
    for event in prof.events():
        if event.thread == thread and event.name in ("aten::mm", "aten::addmm", "aten::bmm") and event.input_shapes:
            shapes = [s for s in event.input_shapes if s]
            calls.append((event.name, [torch.randn(s) for s in shapes]))
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            started = time.thread_time()
            for name, args in calls:
                getattr(torch, name.split("::")[1])(*args)
            best = min(best, time.thread_time() - started)
    return best


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    model, _ = build(os.environ.get("BENCH_MODEL", "gpt"))
    kw = dict(example_inputs=(ids,), loss_fn=lm_loss, example_target=target, hardware="cpu")
    eager = autoshard.compile(copy.deepcopy(model), (world,), **kw)
    compiled = autoshard.compile(copy.deepcopy(model), (world,), plan=eager.plan, compile=True, **kw)
    runs = []
    for label, cm in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)

        def step(cm=cm, opt=opt):
            cm.step(ids, target=target)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        step()
        runs.append((label, step))
    times = {label: [] for label, _ in runs}
    cpu = {label: ([], []) for label, _ in runs}  # (step thread, whole process) CPU seconds per step
    for _ in range(int(os.environ.get("BENCH_ROUNDS", 3))):
        for label, step in runs:
            dist.barrier()
            started, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            step()
            step()
            cpu[label][0].append((time.thread_time() - thread) / 2)
            cpu[label][1].append((time.process_time() - process) / 2)
            dist.barrier()
            times[label].append((time.perf_counter() - started) / 2)
    profiled, matmuls = [], 0.0
    for label, step in runs:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=label == "eager") as prof:
            step()
        profiled.append(shares(prof))
        if label == "eager":
            matmuls = matmul_seconds(prof)
    # per-step CPU seconds averaged over the ranks: step thread, gloo's threads, eager's matmuls alone
    means = {label: (statistics.median(t), statistics.median(p) - statistics.median(t)) for label, (t, p) in cpu.items()}
    flat = torch.tensor([v for label, _ in runs for v in means[label]] + [matmuls], dtype=torch.float64)
    dist.all_reduce(flat)
    flat /= world
    if rank == 0:
        for line in compiled.plan.summary().splitlines():
            if line.startswith("  compiled") or line.startswith("    eager between"):
                print(line)
        med = {label: statistics.median(t) for label, t in times.items()}
        print(f"median ms/step: eager {med['eager'] * 1e3:.0f}, compiled {med['compiled'] * 1e3:.0f}, "
              f"ratio {med['compiled'] / med['eager']:.3f} (rounds {[round(t * 1e3) for t in times['eager']]} / "
              f"{[round(t * 1e3) for t in times['compiled']]})")
        labels = [label for label, _ in CATEGORIES] + ["other"]
        on_step = [sum(v for k, v in s.items() if k != "background") for s in profiled]
        print(f"{'self CPU share of one profiled step (rank 0, its thread)':58s} {'eager':>8s} {'compiled':>9s}")
        for label in labels:
            cells = [100 * s[label] / max(t, 1) for s, t in zip(profiled, on_step)]
            print(f"  {label:56s} {cells[0]:7.1f}% {cells[1]:8.1f}%")
        print(f"  {'total ms on the step thread':56s} {on_step[0] / 1e3:8.0f} {on_step[1] / 1e3:9.0f}")
        print(f"  {'ms on gloo worker threads (beside the step)':56s} {profiled[0]['background'] / 1e3:8.0f} "
              f"{profiled[1]['background'] / 1e3:9.0f}")
        (e_thread, e_gloo, c_thread, c_gloo, mm) = (1e3 * v for v in flat.tolist())
        print(f"{'CPU ms per step, mean over the ranks (medians of the rounds)':58s} {'eager':>8s} {'compiled':>9s}")
        print(f"  {'step thread':56s} {e_thread:8.0f} {c_thread:9.0f}")
        print(f"  {'gloo threads':56s} {e_gloo:8.0f} {c_gloo:9.0f}")
        print(f"  {'process (the two)':56s} {e_thread + e_gloo:8.0f} {c_thread + c_gloo:9.0f}   "
              f"compiled / eager {(c_thread + c_gloo) / (e_thread + e_gloo):.3f}")
        print(f"  {'matmuls alone (eager step shapes, thread_time)':56s} {mm:8.0f}   "
              f"{100 * mm / e_thread:.0f}% of eager's step thread")
        print(f"  floor (matmuls + compiled's gloo threads) / eager process: {(mm + c_gloo) / (e_thread + e_gloo):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
