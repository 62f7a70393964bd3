"""The default plan picture of Llama-3 8B on an (8, 8) H100 mesh: its pixel size, and the file to look at.

    python benchmarks/plan_picture.py [--out plan_llama3_8b.png] [--layers 32] [--batch 8] [--seq 8192]

Plans Hugging Face's LlamaForCausalLM with Llama-3 8B's config on the meta device through
``autoshard.plan`` (as ``benchmarks/plan_time.py`` does), renders ``plan.render(out)`` (block level,
the 32 layers folded into one box) and the op-level graph next to it (``detail="ops"``), and prints
both PNGs' pixel sizes. Goal (issue 12): the default picture fits one 1920 x 1080 screen.
"""
from __future__ import annotations

import argparse
import os
import struct
import time

import torch
import torch.nn.functional as F

import autoshard
from plan_time import llama3_8b


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="plan_llama3_8b.png")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    model = llama3_8b(args.layers, args.seq)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")

    def loss_fn(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    t0 = time.perf_counter()
    plan = autoshard.plan(model, (8, 8), example_inputs=(ids,), loss_fn=loss_fn, example_target=ids.clone(),
                          hardware="h100", time_limit_s=60)
    t1 = time.perf_counter()
    out = plan.render(args.out)
    ops = plan.render(os.path.splitext(args.out)[0] + "_ops.png", detail="ops")
    t2 = time.perf_counter()
    w, h = png_size(out)
    print(f"Llama-3 8B shape ({args.layers} layers), batch {args.batch} x {args.seq}, mesh (8, 8), h100: "
          f"plan {t1 - t0:.1f} s, both pictures {t2 - t1:.1f} s")
    print(f"  default picture {out}: {w} x {h} px ({'fits' if w <= 1920 and h <= 1080 else 'does NOT fit'} "
          f"1920 x 1080)")
    print(f"  op-level picture {ops}: {png_size(ops)[0]} x {png_size(ops)[1]} px")


if __name__ == "__main__":
    main()
