"""Where a step of autoshard eager and autoshard compiled spends its CPU time, side by side: what bounds
``compile=True``'s gain (``benchmarks/compile_step_time.py`` measures the ratio itself).

    torchrun --nproc_per_node 4 benchmarks/compile_profile.py        # BENCH_MODEL=gpt|llama, BENCH_ROUNDS=3

The model, batch, mesh (4,), plan (the solver's for ``hardware="cpu"``) and AdamW step are
``compile_step_time.py``'s. After two warm-up steps (the compiles) and ``BENCH_ROUNDS`` interleaved
rounds of 2 timed steps each, rank 0 profiles one step of each contender with ``torch.profiler`` and
prints the share of the profiled self CPU time per category:

- matmul: ``aten::mm``/``addmm``/``bmm`` (the same oneDNN/MKL kernels eager and compiled);
- attention: ``scaled_dot_product`` kernels (a fallback kernel under inductor as well);
- gradient sync: ``AccumulateGrad`` and ``aten::copy_`` (gradients copied into the all-reduce buckets and
  back) and the collectives (``c10d::``, ``_AllReduce``, ``wait_tensor``);
- optimizer: the ``Optimizer.step`` ops (``_foreach_``/``lerp_``/``addcdiv_``/...);
- compiled graphs: inductor's fused kernels (self time of ``Call CompiledFxGraph``);
- other: everything else (eager elementwise ops, views, Python glue).

Only "other" and part of "compiled graphs" is what fusing can shrink; matmuls and the eager gradient
sync are the same work in both. The medians of the timed rounds are printed too (a loaded machine
moves them a lot: read them as a rough ratio, ``compile_step_time.py`` for the measured one).
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
    ("gradient sync", ("AccumulateGrad", "aten::copy_", "c10d::", "_AllReduce", "wait_tensor", "all_reduce")),
    ("optimizer", ("Optimizer.step", "_foreach_", "lerp_", "addcdiv_", "addcmul_", "aten::sqrt", "aten::div",
                   "_local_scalar_dense")),
    ("compiled graphs", ("CompiledFxGraph",)),
)


def category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def shares(prof) -> Counter:
    out = Counter()
    for event in prof.key_averages():
        out[category(event.key)] += event.self_cpu_time_total
    return out


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
    for _ in range(int(os.environ.get("BENCH_ROUNDS", 3))):
        for label, step in runs:
            dist.barrier()
            started = time.perf_counter()
            step()
            step()
            dist.barrier()
            times[label].append((time.perf_counter() - started) / 2)
    profiled = []
    for label, step in runs:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        profiled.append(shares(prof))
    if rank == 0:
        for line in compiled.plan.summary().splitlines():
            if line.startswith("  compiled") or line.startswith("    eager between"):
                print(line)
        med = {label: statistics.median(t) for label, t in times.items()}
        print(f"median ms/step: eager {med['eager'] * 1e3:.0f}, compiled {med['compiled'] * 1e3:.0f}, "
              f"ratio {med['compiled'] / med['eager']:.3f} (rounds {[round(t * 1e3) for t in times['eager']]} / "
              f"{[round(t * 1e3) for t in times['compiled']]})")
        labels = [label for label, _ in CATEGORIES] + ["other"]
        print(f"{'self CPU share of one profiled step (rank 0)':46s} {'eager':>8s} {'compiled':>9s}")
        for label in labels:
            cells = [100 * s[label] / max(sum(s.values()), 1) for s in profiled]
            print(f"  {label:44s} {cells[0]:7.1f}% {cells[1]:8.1f}%")
        print(f"  {'total ms':44s} {sum(profiled[0].values()) / 1e3:8.0f} {sum(profiled[1].values()) / 1e3:9.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
