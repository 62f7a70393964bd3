"""``compile=True`` against one device on 4 gloo ranks: the slow test's sweep, with its figures.

    python benchmarks/compile_exactness.py [--models gpt,hf_llama,cnn,mixtral] [--backend inductor]

The GPT, an HF Llama, a BatchNorm CNN and an HF Mixtral, each under the solver's plan and a random
plan on mesh (2, 2), every block checkpointed and resharded after forward, compiled with inductor and
trained two SGD steps next to a single-device copy (``autoshard.testing.compile_check``, the harness of
``tests/frontdoor/test_torch_compile_sweep.py``). Per case: the compiled regions, graph breaks, the
largest compile time of a rank (its own compiles, the wait for other ranks excluded), the largest
distance / noise-floor ratio over every compared quantity and rank (the test allows 16), and the
verdict. Cold or warm depends on inductor's cache (``/tmp/torchinductor_<user>``); the wall time of
the whole sweep is printed last.
"""
from __future__ import annotations

import argparse
import time

from autoshard.testing.compile_check import MODELS, compile_worker
from autoshard.testing.ranks import run_ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backend", default="inductor", help="inductor (the default) or aot_eager (what the slow test "
                                                          "runs for every case but one)")
    args = ap.parse_args()
    cases = tuple((name, seed, args.backend) for name in args.models.split(",") for seed in (None, 5))
    started = time.perf_counter()
    per_rank = run_ranks(compile_worker, 4, cases, timeout=7200)
    print(f"{'case':36s} {'regions':>7s} {'breaks':>6s} {'compile s':>9s} {'worst ratio':>11s}  verdict")
    for rows in zip(*per_rank):
        failures = sorted({f for r in rows for f in r.failures})
        print(f"{rows[0].label:36s} {max(r.regions for r in rows):7d} {max(r.graph_breaks for r in rows):6d} "
              f"{max(r.compile_s for r in rows):9.1f} {max(r.worst_ratio for r in rows):11.2f}  "
              + ("ok" if not failures else "; ".join(failures)[:300]))
    print(f"whole sweep: {time.perf_counter() - started:.0f} s wall on 4 ranks")


if __name__ == "__main__":
    main()
