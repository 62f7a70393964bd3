"""``autoshard`` command line: small on purpose.

    autoshard summary PLAN.json     print a saved plan's estimates and parameter placements
"""
from __future__ import annotations

import argparse
import sys

from autoshard.passes.errors import AutoshardError
from autoshard.plan import load_plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autoshard", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="print a saved plan's summary")
    s.add_argument("plan", help="a plan written by Plan.save")
    args = ap.parse_args(argv)
    try:
        if args.command == "summary":
            print(load_plan(args.plan).summary())
    except (AutoshardError, OSError) as e:
        print(f"autoshard: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
