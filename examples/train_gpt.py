"""Train a small GPT with autoshard under torchrun: the whole loop of a long run.

    torchrun --nproc_per_node 4 examples/train_gpt.py            # mesh (2, 2), chosen by the ILP
    torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 4   # a 1-D mesh
    torchrun --nproc_per_node 4 examples/train_gpt.py --pp 2     # 2 pipeline groups, rest planned
    torchrun --nproc_per_node 4 examples/train_gpt.py --pp auto  # the planner decides whether to pipeline

    # checkpoints every 20 steps; after a crash (any rank killed: torchrun ends them all), resume:
    torchrun --nproc_per_node 4 examples/train_gpt.py --checkpoint-dir ckpt
    torchrun --nproc_per_node 4 examples/train_gpt.py --checkpoint-dir ckpt --resume
    torchrun --nproc_per_node 4 examples/train_gpt.py --checkpoint-dir ckpt --resume --pp 2   # another plan

Rank 0 prints the plan summary and writes plan.svg (or plan.dot where graphviz is missing); every
rank trains and prints nothing else; rank 0 reports the loss. With a pipeline, rank 0 prints the
stages and writes the last step's measured timeline of every rank as Chrome trace JSON (``--trace``)
and as SVG next to it.

The loop: AdamW with linear warmup then cosine decay (``LambdaLR``), gradients clipped by their global
norm (``cm.clip_grad_norm_``), and with ``--local-batch`` each rank builds only its data-parallel slice
of the batch (``cm.data_parallel_rank`` / ``cm.data_parallel_size``). With ``--checkpoint-dir`` it saves
every ``--checkpoint-every`` steps into ``<dir>/step_<n>`` (``autoshard.checkpoint``: each rank writes
its shards; the files load without pickle): the model, the optimizer, the LR scheduler, the data
position (the next step; batches are a function of the step) and every rank's RNG state. The first run
also writes the plan to ``<dir>/plan.json``; ``--resume`` loads the newest complete checkpoint and, on
the same mesh, that same plan, so the steps after it repeat an uninterrupted run's bit for bit. Another
``--mesh`` or ``--pp`` plans anew and the checkpoint reshards into it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autoshard  # noqa: E402
from autoshard import checkpoint  # noqa: E402
from autoshard.runtime.groups import finish_distributed  # noqa: E402
from nanogpt import GPT, CharData, generate_corpus, lm_loss, lr_lambda  # noqa: E402


def parse_mesh(text: str, world: int) -> tuple:
    if text:
        return tuple(int(s) for s in text.split(","))
    return (2, world // 2) if world % 2 == 0 and world >= 4 else (world,)


def latest_checkpoint(root: str):
    """(step, path) of the newest complete checkpoint under ``root`` (its metadata is written last)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"step_(\d+)", name)
        if m and os.path.exists(os.path.join(root, name, checkpoint_metadata())):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return max(found) if found else (None, None)


def checkpoint_metadata() -> str:
    from autoshard.runtime.checkpoint_files import METADATA_FILE
    return METADATA_FILE


def training_state(cm, opt, sched, step: int, world: int) -> dict:
    """Everything a resumed run needs, as ``autoshard.checkpoint`` saves it (tensors and JSON values).
    The RNG state is per rank: each rank saves its own under its own key."""
    return {"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt), "scheduler": sched.state_dict(),
            "progress": {"next_step": step, "world": world}, "rng": rng_state()}


def rng_state() -> dict:
    return {f"rank{int(os.environ.get('RANK', '0'))}": torch.get_rng_state()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="", help="comma-separated mesh shape, e.g. 2,2 (default: 2 x world/2)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch size")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=5, help="LR warmup steps (then cosine decay)")
    ap.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off)")
    ap.add_argument("--local-batch", action="store_true", help="each rank builds only its data-parallel slice")
    ap.add_argument("--plan-svg", default="plan.svg")
    ap.add_argument("--pp", default=None, help='pipeline groups: an integer, or "auto" to let the planner choose')
    ap.add_argument("--trace", default="pipeline_trace.json", help="the measured pipeline timeline (and .svg)")
    ap.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (step_<n> subdirectories)")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    ap.add_argument("--loss-log", default=None, help="rank 0 appends {step: loss} JSON lines here")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = parse_mesh(args.mesh, world)
    pp = None if args.pp is None else (args.pp if args.pp == "auto" else int(args.pp))

    data = CharData(generate_corpus())
    torch.manual_seed(0)
    model = GPT(vocab=data.vocab, d=64, n_layer=2, n_head=4, seq=args.seq)
    x, y = data.batch(args.batch, args.seq, step=0)
    resume_step, resume_path = latest_checkpoint(args.checkpoint_dir) if args.resume else (None, None)
    if args.resume and resume_path is None:
        raise SystemExit(f"--resume: no complete checkpoint under {args.checkpoint_dir}")
    saved_plan = os.path.join(args.checkpoint_dir, "plan.json") if args.checkpoint_dir else None
    same_plan = resume_path is not None and pp is None and os.path.exists(saved_plan)
    if same_plan and autoshard.load_plan(saved_plan).mesh.shape != mesh:
        same_plan = False  # another mesh: plan anew, the checkpoint reshards
    cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, pp=pp,
                           plan=autoshard.load_plan(saved_plan) if same_plan else None)
    pipelined = cm.plan.pipelined
    if rank == 0:
        if pipelined:
            p = cm.plan
            print(f"pipeline: pp {p.pp}, schedule {p.schedule}, {p.microbatches} microbatches", flush=True)
            for s in p.stages:
                print(f"  stage {s.index}: ranks {s.ranks}, submesh {s.mesh.shape}, {len(s.nodes)} ops"
                      f"{', recompute' if s.recompute else ''}", flush=True)
        else:
            print(cm.plan.summary(), flush=True)
            if args.checkpoint_dir and not same_plan:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                cm.plan.save(saved_plan)
        try:
            print("partition drawn to", (cm if pipelined else cm.plan).render(args.plan_svg), flush=True)
        except RuntimeError as e:
            print(e, flush=True)
    opt = torch.optim.AdamW(cm.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    start = 0
    if resume_path is not None:
        state = training_state(cm, opt, sched, 0, world)
        del state["rng"]
        checkpoint.load(state, resume_path)
        cm.load_state_dict(state["model"])
        cm.load_optimizer_state_dict(opt, state["optim"])
        sched.load_state_dict(state["scheduler"])
        start = state["progress"]["next_step"]
        if state["progress"]["world"] == world:  # the same ranks: each takes its own RNG state back
            rng = {"rng": rng_state()}
            checkpoint.load(rng, resume_path)
            torch.set_rng_state(rng["rng"][f"rank{rank}"])
        if rank == 0:
            print(f"resumed from {resume_path} at step {start}", flush=True)
    first = last = None
    for step in range(start, args.steps):
        x, y = data.batch(args.batch, args.seq, step=step)
        if args.local_batch:  # this rank's rows only, as a DistributedSampler would hand them out
            rows = args.batch // cm.data_parallel_size
            x, y = (t[cm.data_parallel_rank * rows:(cm.data_parallel_rank + 1) * rows] for t in (x, y))
        loss = cm.step(x, target=y, local_batch=args.local_batch)
        if args.clip > 0:
            cm.clip_grad_norm_(args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        first = loss if first is None else first
        last = loss
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.hex()}) + "\n")
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}  lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            checkpoint.save(training_state(cm, opt, sched, step + 1, world),
                            os.path.join(args.checkpoint_dir, f"step_{step + 1}"))
    if pipelined:
        from autoshard.runtime.pipeline.timelines import write_chrome_trace
        from autoshard.runtime.pipeline.timelines import draw_measured_timeline
        timelines = cm.gather_timelines()  # every rank takes part
        if rank == 0:
            svg = draw_measured_timeline(timelines, os.path.splitext(args.trace)[0] + ".svg")
            print("measured timeline written to", write_chrome_trace(timelines, args.trace), "and", svg, flush=True)
    if rank == 0 and first is not None:
        verdict = "fell" if last < first else "DID NOT FALL"
        print(f"loss {verdict}: {first:.4f} -> {last:.4f} over steps {start}..{args.steps - 1} on mesh {mesh}",
              flush=True)


if __name__ == "__main__":
    main()
    finish_distributed(exit_process=True)  # every rank waits for the others, then leaves (see its docstring)
