"""Checkpoint save / load time and bytes per rank, next to gathering ``full_state_dict()`` + ``torch.save``.

    torchrun --nproc_per_node 4 benchmarks/checkpoint_io.py [--width 384 --layers 6] [--rounds 3]

``autoshard.testing.models.GPT`` with fused qkv (op for op examples/nanogpt.py's; d 384, 6 layers:
10.8 M parameters, 43 MB in fp32) under three
plans on 4 gloo ranks: data parallel (4,), FSDP (4,) and the solver's (2, 2) plan. For each, after
one AdamW step, interleaved rounds (medians) of

- ``autoshard.checkpoint.save`` / ``load`` of the model alone and of model + optimizer state (every
  rank writes its own pieces, replicated pieces once; JSON metadata, raw bytes, fsync'd);
- stock ``torch.distributed.checkpoint.save`` / ``load`` of the same state dicts (pickled metadata);
- the baseline: ``cm.full_state_dict()`` (every full tensor gathered onto every rank), rank 0
  ``torch.save``-ing it (fsync'd); to load, every rank ``torch.load``-s it and ``cm.load_state_dict``.

Bytes per rank are the sizes of the files each rank wrote. Rank 0 prints a table.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autoshard
from autoshard import checkpoint, presets
from autoshard.testing.models import GPT, lm_loss


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _rank_bytes(path: str, rank: int) -> int:
    """Bytes this rank wrote under ``path``: its data files (and rank 0 the metadata)."""
    total = 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        mine = (name.startswith(f"rank{rank}.") or name.startswith(f"__{rank}_")
                or (rank == 0 and name.startswith(".metadata")))
        if mine and os.path.isfile(full):
            total += os.path.getsize(full)
    return total


def _torch_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def measure(cm, opt, root: str, rank: int, rounds: int) -> dict:
    results: dict = {}

    def add(key, seconds, nbytes=None):
        results.setdefault(key, {"s": [], "bytes": nbytes})["s"].append(seconds)
        if nbytes is not None:
            results[key]["bytes"] = nbytes

    for r in range(rounds):
        for what in ("model", "model+optim"):
            def state():
                s = {"model": cm.state_dict()}
                if what == "model+optim":
                    s["optim"] = cm.optimizer_state_dict(opt)
                return s
            for fmt in ("autoshard", "dcp"):
                path = os.path.join(root, f"{fmt}_{what}_{r}")
                if fmt == "autoshard":
                    secs = _timed(lambda: checkpoint.save(state(), path))
                else:
                    secs = _timed(lambda: dcp.save(state(), checkpoint_id=path))
                add((what, fmt, "save"), secs, _rank_bytes(path, rank))
                target = state()
                if fmt == "autoshard":
                    secs = _timed(lambda: (checkpoint.load(target, path), cm.load_state_dict(target["model"])))
                else:
                    secs = _timed(lambda: (dcp.load(target, checkpoint_id=path), cm.load_state_dict(target["model"])))
                add((what, fmt, "load"), secs)
        path = os.path.join(root, f"full_{r}.pt")
        secs = _timed(lambda: (lambda full: _torch_save(full, path) if rank == 0 else None)(cm.full_state_dict()))
        add(("model", "full_state_dict + torch.save", "save"), secs, os.path.getsize(path) if rank == 0 else 0)
        secs = _timed(lambda: cm.load_state_dict(torch.load(path, weights_only=True)))
        add(("model", "full_state_dict + torch.save", "load"), secs)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = args.dir or (tempfile.mkdtemp(prefix="autoshard_ckpt_") if rank == 0 else None)
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    torch.manual_seed(0)
    seq, batch = 64, 8
    model = GPT(vocab=256, d=args.width, n_layer=args.layers, n_head=4, seq=seq, fused_qkv=True)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    plans = {"DP (4,)": ((4,), presets.data_parallel((4,))), "FSDP (4,)": ((4,), presets.fully_sharded(model, (4,))),
             "solver (2, 2)": ((2, 2), {})}
    rows = []
    for label, (mesh, pins) in plans.items():
        cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, hardware="cpu",
                               **pins)
        opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)
        cm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        res = measure(cm, opt, os.path.join(root, label.split()[0]), rank, args.rounds)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {k: v["bytes"] for k, v in res.items() if v["bytes"] is not None})
        for (what, fmt, op), v in res.items():
            if op != "save":
                continue
            load = res[(what, fmt, "load")]["s"]
            sizes = [p[(what, fmt, op)] for p in per_rank]
            rows.append((label, what, fmt, statistics.median(v["s"]), statistics.median(load), sizes))
        del cm, opt
    if rank == 0:
        print(f"GPT d {args.width}, {args.layers} layers: {n_params / 1e6:.1f} M parameters "
              f"({n_params * 4 / 1e6:.1f} MB fp32, AdamW state 2x that); {world} gloo ranks; medians of "
              f"{args.rounds} rounds")
        print("| plan | state | how | save (s) | load (s) | bytes written per rank (MB) |")
        print("|---|---|---|---|---|---|")
        for label, what, fmt, save_s, load_s, sizes in rows:
            mb = " / ".join(f"{s / 1e6:.1f}" for s in sizes)
            print(f"| {label} | {what} | {fmt} | {save_s:.3f} | {load_s:.3f} | {mb} |")
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
