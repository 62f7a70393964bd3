"""Train a small GPT that survives losing nodes: ``autoshard.elastic.run`` under an elastic torchrun.

    # on each of two "nodes" (here: two agents on one machine), 2 ranks each; a node may die and come back
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # lets a node rejoin (see autoshard/elastic.py)
    torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
             --rdzv-id=gpt --max-restarts=3 examples/train_elastic.py --checkpoint-dir ckpt

    python examples/train_elastic.py --checkpoint-dir ckpt      # alone: a world of 1, same training

World 4 runs on mesh (2, 2) (nodes x ranks per node); when one agent dies, torchrun restarts the
survivor's ranks on world 2, which plan (or load the plan cached for world 2) a 1-D mesh, reshard the
last checkpoint and go on. Each start prints one line: old world -> new world, old plan -> new plan,
the estimated step time before and after, re-plan and reshard seconds and the work lost. The batch of
step s is the same global batch on every world (``CharData.batch(step=s)``), so the loss trace equals
an unbroken run's. Rank 0 appends ``{"step", "loss" (float.hex), "world"}`` lines to ``--loss-log``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autoshard.elastic  # noqa: E402
from autoshard.runtime.groups import finish_distributed  # noqa: E402
from nanogpt import GPT, CharData, generate_corpus, lm_loss, lr_lambda  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    ap.add_argument("--stop-after", type=int, default=None, help="end with a checkpoint after this many steps")
    ap.add_argument("--batch", type=int, default=16, help="global batch size (any world)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--adam-eps", type=float, default=1e-8,
                    help="AdamW's eps (the tests use 1e-6: see tests/runtime/test_elastic.py)")
    ap.add_argument("--devices-per-node", type=int, default=None, help="default: torchrun's --nproc-per-node")
    ap.add_argument("--memory-limit", type=int, default=None, help="bytes per device the plan must fit")
    ap.add_argument("--loss-log", default=None, help="rank 0 appends JSON lines {step, loss, world} here")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="sleep this long after each step (tests keep a tiny run alive long enough to kill it)")
    ap.add_argument("--collective-timeout", type=float, default=300.0,
                    help="seconds a collective may wait for a peer before the rank fails (and torchrun restarts it)")
    args = ap.parse_args()
    data = CharData(generate_corpus())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    def build_model():
        torch.manual_seed(0)
        return GPT(vocab=data.vocab, d=args.width, n_layer=args.layers, n_head=4, seq=args.seq)

    def on_step(step: int, loss: float) -> None:
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.hex(), "world": world}) + "\n")
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.4f}  world {world}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    def make_batches(step: int):
        """The global batch of ``step``: the same on every world size."""
        x, y = data.batch(args.batch, args.seq, step=step)
        return (x,), y

    result = autoshard.elastic.run(
        build_model, make_batches, args.steps, args.checkpoint_dir, every=args.every, loss_fn=lm_loss,
        devices_per_node=args.devices_per_node,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, eps=args.adam_eps),
        make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(5, args.steps)),
        stop_after=args.stop_after, on_step=on_step, memory_limit=args.memory_limit,
        collective_timeout_s=args.collective_timeout, log=lambda line: print(line, flush=True))
    if rank == 0:
        print(f"done: steps {result.first_step}..{result.next_step - 1} on world {world}", flush=True)


if __name__ == "__main__":
    main()
    finish_distributed(exit_process=True)  # every rank waits for the others, then leaves (see its docstring)
