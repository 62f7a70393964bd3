"""Train a small GPT with autoshard under torchrun.

    torchrun --nproc_per_node 4 examples/train_gpt.py            # mesh (2, 2), chosen by the ILP
    torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 4   # a 1-D mesh
    torchrun --nproc_per_node 4 examples/train_gpt.py --pp 2     # 2 pipeline groups, rest planned
    torchrun --nproc_per_node 4 examples/train_gpt.py --pp auto  # the planner decides whether to pipeline

Rank 0 prints the plan summary and writes plan.svg (or plan.dot where graphviz is missing); every
rank trains on the same global batches and prints nothing else; rank 0 reports the loss. With a
pipeline, rank 0 prints the stages and writes the last step's measured timeline of every rank as
Chrome trace JSON (``--trace``, for chrome://tracing or Perfetto) and as SVG next to it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autoshard  # noqa: E402
from nanogpt import GPT, CharData, generate_corpus, lm_loss  # noqa: E402


def parse_mesh(text: str, world: int) -> tuple:
    if text:
        return tuple(int(s) for s in text.split(","))
    return (2, world // 2) if world % 2 == 0 and world >= 4 else (world,)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="", help="comma-separated mesh shape, e.g. 2,2 (default: 2 x world/2)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch size")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--plan-svg", default="plan.svg")
    ap.add_argument("--pp", default=None, help='pipeline groups: an integer, or "auto" to let the planner choose')
    ap.add_argument("--trace", default="pipeline_trace.json", help="the measured pipeline timeline (and .svg)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = parse_mesh(args.mesh, world)

    data = CharData(generate_corpus())
    torch.manual_seed(0)
    model = GPT(vocab=data.vocab, d=64, n_layer=2, n_head=4, seq=args.seq)
    x, y = data.batch(args.batch, args.seq, step=0)
    pp = None if args.pp is None else (args.pp if args.pp == "auto" else int(args.pp))
    cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, pp=pp)
    pipelined = not hasattr(cm.plan, "summary")
    if rank == 0:
        if pipelined:
            p = cm.plan
            print(f"pipeline: pp {p.pp}, schedule {p.schedule}, {p.microbatches} microbatches", flush=True)
            for s in p.stages:
                print(f"  stage {s.index}: ranks {s.ranks}, submesh {s.mesh.shape}, {len(s.nodes)} ops"
                      f"{', recompute' if s.recompute else ''}", flush=True)
        else:
            print(cm.plan.summary(), flush=True)
        try:
            print("partition drawn to", (cm if pipelined else cm.plan).render(args.plan_svg), flush=True)
        except RuntimeError as e:
            print(e, flush=True)
    opt = torch.optim.AdamW(cm.parameters(), lr=3e-3)
    first = last = None
    for step in range(args.steps):
        x, y = data.batch(args.batch, args.seq, step=step)
        loss = cm.step(x, target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = loss if first is None else first
        last = loss
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    if pipelined:
        from autoshard.runtime.pipeline.executor import write_chrome_trace
        from autoshard.runtime.pipeline.timelines import draw_measured_timeline
        timelines = cm.gather_timelines()  # every rank takes part
        if rank == 0:
            svg = draw_measured_timeline(timelines, os.path.splitext(args.trace)[0] + ".svg")
            print("measured timeline written to", write_chrome_trace(timelines, args.trace), "and", svg, flush=True)
    if rank == 0:
        verdict = "fell" if last < first else "DID NOT FALL"
        print(f"loss {verdict}: {first:.4f} -> {last:.4f} over {args.steps} steps on mesh {mesh}", flush=True)


if __name__ == "__main__":
    main()
