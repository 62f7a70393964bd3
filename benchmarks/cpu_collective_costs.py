"""What a collective costs inside a CPU step, measured apart from any step: the runtime's own work around
the call, and the call's price after more or less local work.

    python benchmarks/cpu_collective_costs.py [--repeats 7]      # starts torchrun 4 itself

On 4 gloo ranks, side by side in one run (each row: the slowest rank's median, ``profiling/timer.py``):

1. per kind and size, on a (8, n) float32 activation split on dim 1 (as a tensor-parallel step moves
   them): the bare ``torch.distributed`` call on a buffer laid out for it (what the profile's fits
   time), the runtime's step (``runtime.collectives.raw_step``: layout copies and allocations around the
   call), and the runtime's autograd collective forward + backward, halved; each after the same local
   work (a layer norm + GELU), the work's own time taken off; and what ``passes/cost/runtime_host.py``
   adds to the bare call's price for the runtime step;
2. an all-reduce of 32 KiB after 16 KiB .. 4 MiB of that local work: what the call adds to a step as the
   work before it grows (on 2 cores the 4 ranks reach the call at different times).

Nothing here is fitted to ``benchmarks/fidelity.py``'s steps; it is how one checks, on a quiet machine,
whether the profile's collective fits are what a step pays.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fidelity import relaunch_under_torchrun  # noqa: E402


def _work(kib: int):
    import torch
    x = torch.randn(max(1, kib * 1024 // 4 // 256), 256)
    return lambda: torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (256,)))


def run(args) -> None:
    import torch
    import torch.distributed as dist

    from autoshard.passes.cost.hardware import PRESETS
    from autoshard.passes.cost.runtime_host import step_host
    from autoshard.profiling.timer import Timer
    from autoshard.runtime import collectives as rc

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    timer = Timer(torch.device("cpu"), args.repeats, world)
    comm = rc.AxisComm("x", world, rank, dist.group.WORLD)
    work = _work(64)
    alone = timer(work, 20, fence=True)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} gloo ranks on {os.cpu_count()} cores; load average {os.getloadavg()}; local work alone "
        f"{alone * 1e3:.3f} ms")
    say("| kind | local KiB | bare call ms | runtime step ms | runtime autograd (fwd+bwd)/2 ms | step - bare ms | "
        "runtime_host ops, copied KiB |\n|---|---|---|---|---|---|---|")
    for kib in (16, 128, 512):
        cols = kib * 1024 // 4 // 8
        for kind, static in (("all_reduce", ()), ("all_to_all", (1, 0)), ("all_gather", (1,))):
            act = torch.randn(8, cols)
            flat = act.reshape(-1).clone()
            out = torch.empty(flat.numel() * (world if kind == "all_gather" else 1))
            bare = {"all_reduce": lambda: dist.all_reduce(flat),
                    "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(flat), flat),
                    "all_gather": lambda: rc._all_gather_single(out, flat)}[kind]
            t_bare = timer(lambda: (work(), bare()), 10, fence=True) - alone
            t_step = timer(lambda: (work(), rc.raw_step(act, kind, static, comm)), 10, fence=True) - alone
            x = act.clone().requires_grad_()
            call = {"all_reduce": lambda: rc.all_reduce(x, comm), "all_to_all": lambda: rc.all_to_all(x, 1, 0, comm),
                    "all_gather": lambda: rc.all_gather(x, 1, comm)}[kind]

            def fwd_bwd():
                work()
                y = call()
                work()
                y.backward(torch.ones_like(y))
            t_auto = (timer(fwd_bwd, 10, fence=True) - 2 * alone) / 2
            group = act.numel() * 4 * (world if kind in ("all_gather", "all_to_all") else 1)
            ops, copied = step_host(kind, static[0] if static else None, group, world)
            say(f"| {kind} | {kib} | {t_bare * 1e3:.3f} | {t_step * 1e3:.3f} | {t_auto * 1e3:.3f} | "
                f"{(t_step - t_bare) * 1e3:+.3f} | {ops}, {copied / 1024:.0f} |")
    say("\n| local work before the call, KiB | work alone ms | work + all_reduce 32 KiB ms | the call adds ms |\n"
        "|---|---|---|---|")
    buf = torch.ones(8192)
    for kib in (16, 64, 256, 1024, 4096):
        w = _work(kib)
        t_alone = timer(w, 10, fence=True)
        t_both = timer(lambda: (w(), dist.all_reduce(buf)), 10, fence=True)
        say(f"| {kib} | {t_alone * 1e3:.3f} | {t_both * 1e3:.3f} | {(t_both - t_alone) * 1e3:.3f} |")
    say(f"(the cpu preset prices one op dispatch at {PRESETS['cpu'].op_overhead_s * 1e6:.0f} us; a measured profile "
        "sets its own)")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    relaunch_under_torchrun(__file__, args.nproc)
    run(args)


if __name__ == "__main__":
    main()
