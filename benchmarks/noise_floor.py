"""How close do correct float32 programs come to the equivalence harness's measured bound?

Trains the Hugging Face zoo (``autoshard.testing.hf_zoo``) on 4 gloo ranks under the zoo's cases
twice:

- in float64 (model, inputs and one-device reference): a correct plan agrees to ~1e-12, so any
  failure at ``FLOAT64_TOL`` (1e-9 relative) is a bug, not rounding -- unless the model itself computes
  parts in float32 whatever its dtype (Hugging Face's RMSNorm and rotary embeddings cast to float32),
  where the largest difference shown is that float32 island's rounding (~1e-9), not a plan's error
  (which is the size of the value itself);
- in float32 with ``NoiseFloor``: for every compared quantity (loss per step, each first-step gradient,
  each final tensor) the program's distance from a float64 twin divided by the float32 one-device
  run's own distance (its noise floor). The test suite allows ``NoiseFloor.factor`` (16) times the floor;
  this prints the distribution of the ratios it actually sees, per model and overall.

    python benchmarks/noise_floor.py [--models clip,llama] [--skip-float64]
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import time

import torch

from autoshard.testing.hf_zoo import ZOO
from autoshard.testing.ranks import run_ranks
from autoshard.testing.zoo_check import CASES, FLOAT64_TOL, TOL, merge_results, zoo_worker


def _quantile(sorted_values: list, q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--skip-float64", action="store_true")
    args = ap.parse_args()
    names = args.models.split(",")
    if not args.skip_float64:
        t = time.perf_counter()
        res = merge_results(run_ranks(zoo_worker, 4, names, CASES, 2, 20.0, torch.float64, FLOAT64_TOL, timeout=3600))
        print(f"float64 (tolerance {FLOAT64_TOL.rtol:g} relative), {time.perf_counter() - t:.0f} s:")
        for name, r in res.items():
            errors = [float(m) for f in r.failures for m in re.findall(r"max err ([0-9.e+-]+)", f)]
            shown = f"largest difference {max(errors):.3g} ({len(errors)} tensors past the tolerance)" if errors \
                else (r.failures[0][:160] if r.failures else "")
            print(f"  {name:20s} {r.status:14s} {shown}")
    t = time.perf_counter()
    floor = dataclasses.replace(TOL, ratios=[])
    res = merge_results(run_ranks(zoo_worker, 4, names, CASES, 2, 20.0, torch.float32, floor, timeout=3600))
    print(f"\nfloat32 against the float64 twin: distance / float32 noise floor (bound {floor.factor:g}), "
          f"{time.perf_counter() - t:.0f} s:")
    print(f"  {'model':20s} {'status':14s} {'compared':>8s} {'median':>8s} {'p99':>8s} {'max':>8s}  worst quantity")
    everything = []
    for name, r in res.items():
        ratios = sorted(x for _, x in r.noise_ratios)
        everything += ratios
        worst = max(r.noise_ratios, key=lambda nr: nr[1])[0] if r.noise_ratios else \
            "no float64 twin (an op without a float64 kernel): fixed tolerance"
        print(f"  {name:20s} {r.status:14s} {len(ratios):8d} {_quantile(ratios, 0.5):8.2f} "
              f"{_quantile(ratios, 0.99):8.2f} {ratios[-1] if ratios else float('nan'):8.2f}  {worst}")
    everything.sort()
    print(f"  {'all':20s} {'':14s} {len(everything):8d} {_quantile(everything, 0.5):8.2f} "
          f"{_quantile(everything, 0.99):8.2f} {everything[-1] if everything else float('nan'):8.2f}")


if __name__ == "__main__":
    main()
