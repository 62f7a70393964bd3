"""``autoshard solve`` on the four public IOPDDL contest instances, each under its contest time limit.

    python benchmarks/iopddl.py [--only A G] [--scale 0.25] [--dir /work/shared/benchmarks/iopddl]

Runs the real command (a fresh process per instance, so imports and file reading count against the
limit, as in the contest), re-checks the printed answer with ``verify`` (``passes/iopddl/problem.py``)
and prints one row per instance: cost, ratio to the best contest entry, wall time, whether the limit
was respected.
``--scale`` multiplies the time limits (for quick looks; the table then says so).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from autoshard.passes.iopddl.problem import read_problem, verify

INSTANCES = {  # name: (contest time limit s, best cost reached by any contest team)
    "A": (60, 6_548_641_531),
    "G": (120, 217_039),
    "M": (180, 49_928_460_991),
    "S": (240, 1_534_613_444),
}


def run_one(path: str, limit: float) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "solve", path, "--timeout", str(limit)],
                         capture_output=True, text=True, timeout=limit + 120)
    wall = time.perf_counter() - t
    lines = out.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines else []
    first = next((float(line.split("s ")[0]) for line in lines if " best " in line), None)
    row = {"wall_s": wall, "first_s": first, "answer": answer, "rc": out.returncode}
    if answer:
        v = verify(read_problem(path), answer)
        row.update(cost=v.cost, feasible=v.feasible)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/work/shared/benchmarks/iopddl")
    ap.add_argument("--only", nargs="*", default=list(INSTANCES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the contest time limits")
    args = ap.parse_args()
    print(f"time limits x {args.scale}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    print(f"{'inst':4} {'limit s':>7} {'wall s':>7} {'first s':>7} {'cost':>18} {'best contest':>16} "
          f"{'ratio':>8} {'ok':>3}")
    for name in args.only:
        limit, best = INSTANCES[name]
        limit *= args.scale
        row = run_one(os.path.join(args.dir, f"asplos-2025-iopddl-{name}.json.gz"), limit)
        cost = row.get("cost")
        ratio = f"{cost / best:8.3f}" if cost is not None else "     n/a"
        ok = "yes" if row.get("feasible") and row["wall_s"] <= limit else "no"
        first = f"{row['first_s']:7.1f}" if row["first_s"] is not None else "    n/a"
        print(f"{name:4} {limit:7.0f} {row['wall_s']:7.1f} {first} {str(cost):>18} {best:16,d} {ratio} {ok:>3}",
              flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
