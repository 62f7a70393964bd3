"""Step time of autoshard's pipeline runtime against torch.distributed.pipelining, side by side.

    torchrun --nproc_per_node 4 benchmarks/pipeline_step_time.py [--layers 8 --d 128 --seq 64 --batch 32 --micro 8]

A GPT (``autoshard.testing.models``, untied embeddings so both sides hold the same stages) cut into 4 stages at
the same block boundaries, one stage per rank (pp=4), on gloo (CPU). autoshard: ``PipelineProgram``
with the ``1f1b`` schedule from ``passes.pipeline.schedule.generators``. torch: ``PipelineStage`` +
``Schedule1F1B`` over hand-cut stage modules. A step is forward + backward of the global batch in
``--micro`` microbatches + AdamW step. Rounds of ``--iters`` steps interleave the two (ABBA order, so
neither side always runs first) so machine noise hits both; each round pair gives one ratio.
Prints each side's median ms/step with its quartiles, the ratio of the medians and the median of the
per-round ratios with their range (below 1.0 means autoshard is faster), the load average before
and after, and writes the last autoshard step's measured timeline as Chrome trace JSON (``--trace``;
each event also records the time its action waited on receives).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.solve.context import PlanContext


class _First(nn.Module):
    def __init__(self, m: GPT, blocks):
        super().__init__()
        self.wte, self.wpe, self.blocks = m.wte, m.wpe, nn.ModuleList(blocks)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return x


class _Middle(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Last(nn.Module):
    def __init__(self, m: GPT, blocks):
        super().__init__()
        self.blocks, self.ln_f, self.head = nn.ModuleList(blocks), m.ln_f, m.head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def timed(fn, iters: int, cpu: list) -> float:
    """Wall seconds per step (all ranks, barrier to barrier); appends this rank's CPU seconds per step
    (all its threads: compute, gloo) to ``cpu``."""
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(iters):
        fn()
    cpu.append((time.process_time() - c) / iters)
    dist.barrier()
    return (time.perf_counter() - t) / iters


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=None, help="override the runtime's receive prefetch depth")
    ap.add_argument("--trace", default="pipeline_trace.json")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.pipeline.timelines import write_chrome_trace
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    vocab, L, pp, m = 256, args.layers, world, args.micro
    model = GPT(vocab, args.d, L, 4, args.seq, tied=False)
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    target = torch.randint(0, vocab, (args.batch, args.seq))
    per = L // pp
    cuts = [per * k for k in range(1, pp)]

    # autoshard
    mb = args.batch // m
    captured = capture(model, (ids[:mb],), loss_fn=lm_loss, target=target[:mb])
    nodes = stage_nodes_from_prefixes(captured, [f"blocks.{c}" for c in cuts])
    plan = make_pipeline_plan(captured, nodes, (pp,), schedule="1f1b", microbatches=m,
                              solve=lambda g, sm: plan_sharding(g.captured, sm,
                                                                PlanContext.of("cpu", time_limit_s=10)))
    prog = RankProgram(plan.attach(captured), schedule=generate("1f1b", pp, m), model=model)
    if args.prefetch is not None:
        prog.interpreter.prefetch = args.prefetch
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-4)

    def ours():
        prog.step(ids, target=target)
        opt.step(); opt.zero_grad()

    # torch.distributed.pipelining on a copy with the same stages
    torch.manual_seed(0)
    ref = GPT(vocab, args.d, L, 4, args.seq, tied=False)
    ref.load_state_dict(model.state_dict())
    bounds = [0] + cuts + [L]
    blocks = list(ref.blocks)[bounds[rank]:bounds[rank + 1]]
    sub = _First(ref, blocks) if rank == 0 else _Last(ref, blocks) if rank == pp - 1 else _Middle(blocks)
    stage = PipelineStage(sub, rank, pp, torch.device("cpu"))
    sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
    topt = torch.optim.AdamW(sub.parameters(), lr=1e-4)

    def theirs():
        if rank == 0:
            sched.step(ids)
        elif rank == pp - 1:
            sched.step(target=target, losses=[])
        else:
            sched.step()
        topt.step(); topt.zero_grad()

    load0 = os.getloadavg()
    for _ in range(2):
        ours(); theirs()
    a, b, cpu_a, cpu_b = [], [], [], []
    for k in range(args.rounds):
        if k % 4 in (0, 3):
            a.append(timed(ours, args.iters, cpu_a))
            b.append(timed(theirs, args.iters, cpu_b))
        else:
            b.append(timed(theirs, args.iters, cpu_b))
            a.append(timed(ours, args.iters, cpu_a))
    load1 = os.getloadavg()
    ratios = [x / y for x, y in zip(a, b)]
    cpu = torch.tensor([statistics.median(cpu_a), statistics.median(cpu_b)], dtype=torch.float64)
    dist.all_reduce(cpu)
    timelines = [None] * world
    dist.all_gather_object(timelines, [(e.action, e.start, e.end, e.wait) for e in prog.timeline])
    if rank == 0:
        from autoshard.runtime.pipeline.interpreter import TimelineEvent
        write_chrome_trace({r: [TimelineEvent(r, *e) for e in evs] for r, evs in enumerate(timelines)}, args.trace)
        qa, qb, qr = quartiles(a), quartiles(b), quartiles(ratios)
        print(f"GPT {L} layers d={args.d} seq={args.seq} batch={args.batch} microbatches={m}, pp={pp}, 1F1B, gloo CPU, "
              f"{args.rounds} interleaved rounds x {args.iters} steps, prefetch={prog.interpreter.prefetch}")
        print(f"load average (1 min) before / after: {load0[0]:.2f} / {load1[0]:.2f}")
        print(f"autoshard PipelineProgram : {qa[1] * 1e3:8.1f} ms/step median  (quartiles {qa[0] * 1e3:.1f} .. "
              f"{qa[2] * 1e3:.1f})")
        print(f"torch Schedule1F1B        : {qb[1] * 1e3:8.1f} ms/step median  (quartiles {qb[0] * 1e3:.1f} .. "
              f"{qb[2] * 1e3:.1f})")
        print(f"ratio of medians          : {qa[1] / qb[1]:.3f}")
        print(f"CPU s/step, all ranks     : autoshard {cpu[0].item():.3f}, torch {cpu[1].item():.3f} "
              f"(ratio {cpu[0].item() / cpu[1].item():.3f}; medians per rank, summed)")
        print(f"per-round ratio           : median {qr[1]:.3f}, quartiles {qr[0]:.3f} .. {qr[2]:.3f}, "
              f"range {min(ratios):.3f} .. {max(ratios):.3f}, autoshard faster in {sum(r < 1 for r in ratios)}"
              f"/{len(ratios)} rounds")
        waits = {r: sum(e[3] for e in evs) for r, evs in enumerate(timelines)}
        print("autoshard last step, time blocked on receives per rank (ms): "
              + ", ".join(f"{r}: {w * 1e3:.1f}" for r, w in waits.items()))
        print(f"measured timeline written to {args.trace}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
