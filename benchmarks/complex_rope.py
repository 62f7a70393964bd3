"""What the complex-view rules save: a Llama whose RoPE multiplies complex numbers, at Llama-3-8B width.

    python benchmarks/complex_rope.py [--layers 32] [--seq 8192] [--batch 8] [--mesh 8,8]

``autoshard.testing.models.ComplexRopeLlama`` (Meta's reference layout: ``view_as_complex`` of
queries and keys, a product with the complex ``freqs_cis``, ``view_as_real``) built on the meta
device with Llama-3-8B's widths (hidden 4096, FFN 14336, 32 heads / 8 KV heads, vocab 128256,
float32 as Meta's RoPE computes), planned for an H100 mesh under 80 GiB twice in one run: with the
rules, and with the rules of ``view_as_complex``/``view_as_real`` removed (so the RoPE products run
replicated, as before this issue). For each: the plan's estimated memory and step time, or, when no
plan fits, the smallest memory any plan needs (from ``InfeasiblePlanError``), and how many RoPE
products stay replicated.
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.sharding.rules import RULES
from autoshard.passes.spec import Replicate
from autoshard.passes.units import human_bytes
from autoshard.testing.models import ComplexRopeLlama, lm_loss

aten = torch.ops.aten
VIEWS = (aten.view_as_complex.default, aten.view_as_real.default)


def rope_products(captured) -> list[str]:
    return [n.name for n in captured.gm.graph.nodes if n.target in VIEWS or (
        n.target == aten.mul.Tensor and n.meta["autoshard.meta"].dtype.is_complex)]


def measure(captured, mesh, label: str) -> None:
    t0 = time.perf_counter()
    try:
        plan = plan_captured(captured, mesh, hardware="h100", memory_limit=80 * 2 ** 30, time_limit_s=120)
    except InfeasiblePlanError as e:
        need = re.search(r"smallest plan needs (\d+) bytes", str(e))
        print(f"| {label} | no plan fits 80 GiB; the smallest needs {human_bytes(int(need.group(1)))} | - | - | "
              f"{time.perf_counter() - t0:.1f} |")
        return
    rope = rope_products(captured)
    rep = sum(all(isinstance(p, Replicate) for p in plan.strategies[n].outputs[0]) for n in rope)
    print(f"| {label} | {human_bytes(plan.estimated_memory)} | {plan.estimated_step_time:.3f} s | {rep} of {len(rope)} "
          f"| {time.perf_counter() - t0:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mesh", default="8,8")
    args = ap.parse_args()
    mesh = tuple(int(s) for s in args.mesh.split(","))
    with torch.device("meta"):
        model = ComplexRopeLlama(vocab=128256, d=4096, n_layer=args.layers, n_head=32, n_kv_head=8, seq=args.seq,
                                 hidden=14336)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    print(f"ComplexRopeLlama, {args.layers} layers at Llama-3-8B width, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, seq {args.seq}, batch {args.batch}, "
          f"mesh {mesh}, h100, 80 GiB; trace {time.perf_counter() - t0:.1f} s\n")
    print("| rules | estimated memory per device | estimated step | RoPE products replicated | plan s |")
    print("|---|---|---|---|---|")
    measure(captured, mesh, "with complex-view rules")
    for op in VIEWS:
        del RULES[op]
    measure(captured, mesh, "view_as_complex / view_as_real unruled")


if __name__ == "__main__":
    main()
