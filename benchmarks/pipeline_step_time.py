"""Step time of autoshard's pipeline runtime against torch.distributed.pipelining, side by side.

    torchrun --nproc_per_node 4 benchmarks/pipeline_step_time.py [--layers 8 --d 128 --seq 64 --batch 32 --micro 8]

A GPT (tests/models.py's, untied embeddings so both sides hold the same stages) cut into 4 stages at
the same block boundaries, one stage per rank (pp=4), on gloo (CPU). autoshard: ``PipelineProgram``
with the ``1f1b`` schedule from ``passes.pipeline.generators``. torch: ``PipelineStage`` +
``Schedule1F1B`` over hand-cut stage modules. A step is forward + backward of the global batch in
``--micro`` microbatches + AdamW step. Rounds alternate between the two so machine noise hits both.
Prints medians and the ratio autoshard / torch (below 1.0 means autoshard is faster), and writes the
last autoshard step's measured timeline as Chrome trace JSON (``--trace``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import GPT, _cross_entropy  # noqa: E402


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


def timed(fn, iters: int) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - t) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--trace", default="pipeline_trace.json")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from autoshard.passes.capture import capture
    from autoshard.passes.pipeline.generators import generate
    from autoshard.passes.planner import plan_sharding
    from autoshard.runtime.pipeline.executor import PipelineProgram, write_chrome_trace
    from autoshard.runtime.pipeline.split import make_pipeline_plan, stage_nodes_from_prefixes
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
    captured = capture(model, (ids[:mb],), loss_fn=_cross_entropy, target=target[:mb])
    nodes = stage_nodes_from_prefixes(captured, [f"blocks.{c}" for c in cuts])
    plan = make_pipeline_plan(captured, nodes, (pp,), schedule="1f1b", microbatches=m,
                              solve=lambda g, sm: plan_sharding(g.captured, sm, hardware="cpu", time_limit_s=10))
    prog = PipelineProgram(captured, plan, generate("1f1b", pp, m), model=model)
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
    sched = Schedule1F1B(stage, m, loss_fn=_cross_entropy)
    topt = torch.optim.AdamW(sub.parameters(), lr=1e-4)

    def theirs():
        if rank == 0:
            sched.step(ids)
        elif rank == pp - 1:
            sched.step(target=target, losses=[])
        else:
            sched.step()
        topt.step(); topt.zero_grad()

    ours(); theirs()
    a, b = [], []
    for _ in range(args.rounds):
        a.append(timed(ours, args.iters))
        b.append(timed(theirs, args.iters))
    ma, mb_ = statistics.median(a), statistics.median(b)
    timelines = [None] * world
    dist.all_gather_object(timelines, [(e.action, e.start, e.end) for e in prog.timeline])
    if rank == 0:
        from autoshard.runtime.pipeline.interpreter import TimelineEvent
        write_chrome_trace({r: [TimelineEvent(r, *e) for e in evs] for r, evs in enumerate(timelines)}, args.trace)
        print(f"GPT {L} layers d={args.d} seq={args.seq} batch={args.batch} microbatches={m}, pp={pp}, 1F1B, gloo CPU")
        print(f"autoshard PipelineProgram : {ma * 1e3:8.1f} ms/step (median of {args.rounds})")
        print(f"torch Schedule1F1B        : {mb_ * 1e3:8.1f} ms/step")
        print(f"ratio autoshard / torch   : {ma / mb_:.3f}")
        print(f"measured timeline written to {args.trace}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
