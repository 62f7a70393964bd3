"""``autoshard`` command line: small on purpose.

    autoshard summary PLAN.json                 print a saved plan's estimates and parameter placements
    autoshard solve PROBLEM.json[.gz] --timeout S
                                                solve an IOPDDL strategy-graph problem: progress lines
                                                ("<seconds> <best cost>"), then the answer as one JSON
                                                list of strategy indices, last ([] if none was found)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from autoshard.passes.errors import AutoshardError
from autoshard import profile_cli  # torch-free at import; `summary` and `profile` load torch when run


def _solve(path: str, timeout: float, seed: int, start: float, verbose: bool = False) -> None:
    from autoshard.passes.iopddl import read_problem, verify
    from autoshard.passes.solver_search import SearchConfig, solve_problem

    problem = read_problem(path)
    print(f"{time.perf_counter() - start:.2f}s read {problem.num_nodes} nodes, {len(problem.edges)} edges",
          flush=True)

    def progress(elapsed: float, cost: int) -> None:
        print(f"{elapsed:.2f}s best {cost}", flush=True)

    result = solve_problem(problem, timeout, start=start, config=SearchConfig(seed=seed, verbose=verbose),
                           on_progress=progress)
    if result.choice and not verify(problem, result.choice).feasible:  # never print a bad answer
        result.choice = []
    print(f"{time.perf_counter() - start:.2f}s done status {result.status} cost {result.cost} {result.stats}",
          flush=True)
    print(json.dumps(result.choice), flush=True)
    sys.stderr.flush()
    os._exit(0)  # freeing a large problem's objects takes seconds the timeout does not have


def _process_start() -> float:
    """When this process started, on the ``time.perf_counter`` clock (imports count against a
    timeout); now where /proc is unavailable."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        return now - age if 0 <= age < 600 else now
    except (OSError, ValueError, IndexError):
        return now


def main(argv=None) -> int:
    start = _process_start()
    ap = argparse.ArgumentParser(prog="autoshard", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="print a saved plan's summary")
    s.add_argument("plan", help="a plan written by Plan.save")
    v = sub.add_parser("solve", help="solve an IOPDDL problem (JSON or gzipped JSON)")
    v.add_argument("problem", help="PROBLEM.json or PROBLEM.json.gz in the google/iopddl format")
    v.add_argument("--timeout", type=float, default=60.0, help="wall-clock seconds, reading included")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--verbose", action="store_true", help="print search statistics")
    profile_cli.add_parser(sub)
    args = ap.parse_args(argv)
    try:
        if args.command == "summary":
            from autoshard.plan import load_plan
            print(load_plan(args.plan).summary())
        elif args.command == "profile":
            return profile_cli.run(args)
        elif args.command == "solve":
            _solve(args.problem, args.timeout, args.seed, start, args.verbose)
    except (AutoshardError, OSError) as e:
        print(f"autoshard: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
