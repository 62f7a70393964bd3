"""``autoshard solve`` on IOPDDL contest instances, each under its contest time limit.

    python benchmarks/iopddl.py [--only A G] [--scale 0.25] [--dir /work/shared/benchmarks/iopddl]
    python benchmarks/iopddl.py --set unseen --dir DIR   # the other public google/iopddl files

Runs the real command (a fresh process per instance, so imports and file reading count against the
limit, as in the contest), re-checks the printed answer with ``verify`` (``autoshard/contest/iopddl/problem.py``)
and prints one row per instance: cost, ratio to the best contest entry (ours / best: 1.000 is the
best entry's cost), points (best / ours, the contest's score), the lower bound the solver printed and
how far above it the answer is, wall time, the CPU seconds the command got (all its processes; two
dedicated cores would give up to twice the limit), whether the limit was respected. The load
average is printed before each row: the limits are wall-clock and this machine is shared.
``--scale`` multiplies the time limits (for quick looks; the table then says so). ``--compare``
runs each instance a second time right after with ``--no-toulbar2`` (rows ``A-bp``...: the search
the solver used before toulbar2), so the two are measured under about the same load.

``--set unseen`` runs other instances of google/iopddl's ``benchmarks/`` (never tuned on): B C D K
L N P Q R T U V, the ones whose files could be fetched here (E F H I J O W X Y are larger), with
the best cost any team reached in the contest's published final results; ``--dir`` names the
folder holding them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

from autoshard.contest.iopddl.problem import read_problem, verify

INSTANCES = {  # name: (contest time limit s, best cost reached by any contest team)
    "A": (60, 6_548_641_531),
    "G": (120, 217_039),
    "M": (180, 49_928_460_991),
    "S": (240, 1_534_613_444),
}
UNSEEN = {  # the same for the other public instances (contest final results, teams only)
    "B": (60, 532_843),
    "C": (60, 84_102_445_260),
    "D": (60, 313_613_524_736),
    "K": (180, 2_274_276_676),
    "L": (180, 1_970_993_742),
    "N": (180, 202_739_586_553),
    "P": (240, 662_197_407_330),
    "Q": (240, 526_776_842_042),
    "R": (240, 371_899_551_572),
    "T": (240, 682_895_254_913),
    "U": (300, 2_569_342_178),
    "V": (300, 1_632_051),
}


def run_one(path: str, limit: float, extra=()) -> dict:
    t = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "autoshard.cli", "solve", path, "--timeout", str(limit), *extra],
                         capture_output=True, text=True, timeout=limit + 120)
    wall = time.perf_counter() - t
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    lines = out.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines else []
    first = next((float(line.split("s ")[0]) for line in lines if " best " in line), None)
    bound = next((m.group(1) for line in lines for m in [re.search(r"lower_bound (\d+)", line)] if m), None)
    row = {"wall_s": wall, "cpu_s": cpu, "first_s": first, "answer": answer, "rc": out.returncode,
           "bound": int(bound) if bound else None}
    if answer:
        v = verify(read_problem(path), answer)
        row.update(cost=v.cost, feasible=v.feasible)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/work/shared/benchmarks/iopddl")
    ap.add_argument("--set", choices=["public", "unseen"], default="public")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the contest time limits")
    ap.add_argument("--compare", action="store_true",
                    help="also run each instance with --no-toulbar2 (the older search), right after")
    args = ap.parse_args()
    table = INSTANCES if args.set == "public" else UNSEEN
    names = args.only or list(table)
    print(f"time limits x {args.scale}; {os.cpu_count()} CPUs")
    print(f"{'inst':5} {'load':>5} {'limit s':>7} {'wall s':>7} {'cpu s':>6} {'first s':>7} {'cost':>16} {'best contest':>16} "
          f"{'ratio':>7} {'points':>6} {'lower bound':>16} {'gap %':>6} {'ok':>3}")
    points = []  # of the default search only
    runs = [(name, ()) for name in names]
    if args.compare:
        runs = [run for name in names for run in ((name, ()), (name, ("--no-toulbar2",)))]
    for name, extra in runs:
        limit, best = table[name]
        limit *= args.scale
        load = os.getloadavg()[0]
        row = run_one(os.path.join(args.dir, f"asplos-2025-iopddl-{name}.json.gz"), limit, extra)
        if extra:
            name = name + "-bp"
        cost, bound = row.get("cost"), row["bound"]
        ok = bool(row.get("feasible")) and row["wall_s"] <= limit
        score = best / cost if cost and ok else 0.0
        if not extra:
            points.append(score)
        ratio = f"{cost / best:7.3f}" if cost is not None else "    n/a"
        gap = f"{100 * (cost - bound) / cost:6.2f}" if cost and bound is not None else "   n/a"
        first = f"{row['first_s']:7.1f}" if row["first_s"] is not None else "    n/a"
        print(f"{name:5} {load:5.1f} {limit:7.0f} {row['wall_s']:7.1f} {row['cpu_s']:6.0f} {first} {str(cost):>16} {best:16,d} {ratio} "
              f"{score:6.3f} {str(bound):>16} {gap} {'yes' if ok else 'no':>3}", flush=True)
    print(f"mean points {sum(points) / len(points):.3f}, lowest {min(points):.3f}; "
          f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
