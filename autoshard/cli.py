"""``autoshard`` command line: small on purpose.

    autoshard plan SPEC --mesh 8x8 --batch 16 [--seq 8192] [--hardware h100] [--dtype bf16] [--pp auto]
                   [--memory-limit 80GB] [--out plan.json] [--svg plan.svg]
                                                trace and plan a model named on the command line
    autoshard explain PLAN.json NAME            why a parameter or op got its placement
    autoshard diff A.json B.json                what differs between two plans
    autoshard summary PLAN.json                 print a saved plan's estimates and parameter placements
    autoshard solve PROBLEM.json[.gz] --timeout S
                                                solve an IOPDDL strategy-graph problem: progress lines
                                                ("<seconds> <best cost>"), a line with the final cost and
                                                a lower bound on the optimum, then the answer as one
                                                JSON list of strategy indices, last ([] if none was found)
"""
from __future__ import annotations

import argparse
import fcntl
import gc
import glob
import json
import os
import signal
import sys
import tempfile
import time

from autoshard import cli_plan  # torch-free at import, like profile_cli; their commands load torch when run
from autoshard.passes.errors import AutoshardError
from autoshard.profiling import cli as profile_cli  # torch-free at import; `summary` and `profile` load torch when run


def _solve(path: str, timeout: float, seed: int, start: float, verbose: bool = False,
           toulbar2: bool = True) -> None:
    from autoshard.contest.iopddl.problem import read_problem, verify
    from autoshard.contest.iopddl.solver import SearchConfig, solve_problem

    guard = _Watchdog(start + timeout - 1.0 - 0.005 * timeout)
    problem = read_problem(path)
    print(f"{time.perf_counter() - start:.2f}s read {problem.num_nodes} nodes, {len(problem.edges)} edges",
          flush=True)

    def progress(elapsed: float, cost: int) -> None:
        print(f"{elapsed:.2f}s best {cost}", flush=True)

    def answer(choice: list, cost: int) -> None:
        guard.keep(choice)

    def bound(lower_bound: int) -> None:
        guard.keep_bound(lower_bound)

    result = solve_problem(problem, timeout, start=start, config=SearchConfig(seed=seed, verbose=verbose, use_wcsp=toulbar2),
                           on_progress=progress, on_answer=answer, on_bound=bound)
    if result.choice and not verify(problem, result.choice).feasible:  # never print a bad answer
        result.choice = []
    gap = ""
    if result.cost and result.lower_bound is not None:
        gap = f" (at most {100.0 * (result.cost - result.lower_bound) / result.cost:.2f}% above optimal)"
    guard.finish(result.choice, f"{time.perf_counter() - start:.2f}s done status {result.status} "
                                f"cost {result.cost} lower_bound {result.lower_bound}{gap} {result.stats}")


class _Watchdog:
    """Answers by a deadline even when the solver cannot. The process forks: the child solves and
    prints; the parent only waits, and if the child has not printed its answer by the deadline,
    stops it and prints the last answer the child kept (``keep``: a JSON file replaced atomically)
    with the last lower bound it kept (``keep_bound``).
    A thread would not do: a long C call (the JSON parse, a numpy or CP-SAT step) holds the
    interpreter past any Python timer. ``flock`` on a lock file decides who prints the answer, so
    exactly one JSON list comes out, last; the exit status is the child's, or 0 on a timeout."""

    def __init__(self, deadline: float):
        fd, self.path = tempfile.mkstemp(prefix="autoshard-solve-", suffix=".json")
        os.write(fd, b"[]")
        os.close(fd)
        open(self.path + ".lock", "wb").close()  # never replaced, unlike the answer file
        sys.stdout.flush()
        sys.stderr.flush()
        self.child = os.fork()
        if self.child:
            self._wait(deadline)  # never returns

    def _take(self) -> bool:
        """The right to print the answer (each process opens the lock file itself: a descriptor
        shared across the fork would not exclude)."""
        self.lock = open(self.path + ".lock", "rb")
        try:
            fcntl.flock(self.lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False

    def _wait(self, deadline: float) -> None:
        code = None
        while code is None and time.perf_counter() < deadline:
            pid, status = os.waitpid(self.child, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
            else:
                time.sleep(0.02)
        if code is None:
            if self._take():  # the child has not started printing: stop it, answer for it
                os.kill(self.child, signal.SIGKILL)
                os.waitpid(self.child, 0)
                with open(self.path) as f:
                    choice = f.read()
                bound = None
                if os.path.exists(self.path + ".bound"):
                    with open(self.path + ".bound") as f:
                        bound = f.read().strip() or None
                print(f"{time.perf_counter() - deadline:+.2f}s past the watchdog: timeout, the best answer "
                      f"so far; lower_bound {bound}", flush=True)
                print(choice, flush=True)
                code = 0
            else:
                code = os.waitstatus_to_exitcode(os.waitpid(self.child, 0)[1])
        for p in [self.path, self.path + ".lock", self.path + ".bound", self.path + ".btmp",
                  *glob.glob(glob.escape(self.path) + ".*.tmp")]:
            if os.path.exists(p):
                os.unlink(p)
        os._exit(max(code, 0))

    def keep(self, choice: list) -> None:
        """Any process of the solve (its forked worker too) may keep an answer: each writes its own
        temporary file, then replaces the answer file atomically."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(choice, f)
        os.replace(tmp, self.path)

    def keep_bound(self, bound: int) -> None:
        tmp = self.path + ".btmp"
        with open(tmp, "w") as f:
            f.write(str(int(bound)))
        os.replace(tmp, self.path + ".bound")

    def finish(self, choice: list, line: str) -> None:
        if not self._take():  # the watchdog is answering and will stop this process
            while True:
                time.sleep(1.0)
        print(line, flush=True)
        print(json.dumps(choice), flush=True)
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
    """Run one command; returns the exit status. ``argv`` None: the process's own command line (the
    ``autoshard`` script, ``python -m autoshard.cli``), whose end is the process's end: every object
    left is then frozen (``gc.freeze``) so the interpreter's shutdown does not walk them in its
    collections (~2 CPU s after ``autoshard plan`` of Llama-3 8B, of ~20)."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            gc.freeze()


def _main(argv) -> int:
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
    v.add_argument("--no-toulbar2", action="store_true",
                   help="the search without toulbar2 (belief propagation), even where pytoulbar2 is installed")
    profile_cli.add_parser(sub)
    cli_plan.add_parsers(sub)
    args = ap.parse_args(argv)
    try:
        if args.command == "summary":
            from autoshard.plans import load_plan
            print(load_plan(args.plan).summary())
        elif args.command == "profile":
            return profile_cli.run(args)
        elif args.command in ("plan", "explain", "diff"):
            return cli_plan.run(args)
        elif args.command == "solve":
            _solve(args.problem, args.timeout, args.seed, start, args.verbose, not args.no_toulbar2)
    except (AutoshardError, OSError, ValueError, TypeError) as e:
        print(f"autoshard: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
