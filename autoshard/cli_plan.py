"""``autoshard plan`` / ``explain`` / ``diff``: planning from the command line.

    autoshard plan SPEC --mesh 8x8 --batch 16 --seq 8192 --hardware h100 [--dtype bf16] [--pp auto]
                   [--memory-limit 80GB] [--out plan.json] [--svg plan.svg]
                   [--layout megatron:tp=8,pp=16 | --compare fsdp:checkpoint=full]
    autoshard explain plan.json NAME        # a parameter or op: its choice, the next best, what binds
    autoshard diff a.json b.json            # placements, collectives, time and memory that differ

SPEC (``autoshard.model_specs``): a Hugging Face ``config.json``, a model type with overrides
(``llama:num_hidden_layers=32,hidden_size=4096``) or ``package.module:factory``. The model is built on
the meta device (nothing allocated), traced and solved; a progress line goes to stderr every few
seconds while that runs. The plan file stores how the model was built (``Plan.source``), so ``explain``
builds it again, re-traces it (the plan's fingerprint must match) and prices the node's other
strategies with the plan's cost model; for a plan saved from Python, give ``--spec`` (and ``--batch``,
``--seq``, ``--dtype``) to explain. ``plan`` is ``autoshard.plan`` on the built model (memory levers
chosen the same way); with ``--pp`` it may return a pipelined plan, written as
``Plan.save`` writes it (``autoshard.load_plan`` and ``compile(..., plan=)`` read it;
``explain``/``diff`` read plain plans only). ``--layout`` prices that layout (``autoshard.layouts.parse``)
instead of searching; ``--compare`` plans both and prints them side by side
(``autoshard.layout_compare``), writing autoshard's plan.

This module imports nothing heavy at import time (``autoshard solve`` stays torch-free); each command
loads the planner when it runs.
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from typing import Optional

from autoshard.passes.gc_pauses import fewer_gc_pauses  # torch-free

__all__ = ["add_parsers", "run", "parse_mesh", "parse_bytes", "Progress"]

PROGRESS_AFTER_S = 3.0   # the first progress line, if the stage still runs
PROGRESS_EVERY_S = 5.0   # then one per this many seconds
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_mesh(text: str) -> tuple:
    """``8x8``, ``8,8`` or ``64`` -> a mesh shape tuple."""
    parts = [p for p in re.split(r"[x,*]", text.strip()) if p]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mesh {text!r}: give axis sizes like 8x8 (axis 0 outermost) or 64")
    return tuple(int(p) for p in parts)


def parse_bytes(text: Optional[str]) -> Optional[int]:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``8e10`` -> bytes; None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--memory-limit {text!r}: give bytes like 80GB, 80GiB or 8e10")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class Progress:
    """Prints ``<prog>: <stage> ... <seconds> s`` to ``stream`` while a stage runs longer than
    ``PROGRESS_AFTER_S``, then every ``PROGRESS_EVERY_S`` (a daemon thread; ``stage`` starts a new one)."""

    def __init__(self, prog: str, stream=None):
        self.prog, self.stream = prog, stream if stream is not None else sys.stderr
        self._stage, self._since = "", time.perf_counter()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=1.0)

    def stage(self, name: str) -> None:
        with self._lock:
            self._stage, self._since = name, time.perf_counter()

    def _run(self) -> None:
        printed_for, last = None, 0.0
        while not self._done.wait(min(PROGRESS_AFTER_S, PROGRESS_EVERY_S) / 5):
            with self._lock:
                stage, since = self._stage, self._since
            now = time.perf_counter()
            if not stage or now - since < PROGRESS_AFTER_S:
                continue
            if printed_for != (stage, since) or now - last >= PROGRESS_EVERY_S:
                print(f"{self.prog}: {stage} ... {now - since:.0f} s", file=self.stream, flush=True)
                printed_for, last = (stage, since), now


def add_parsers(sub) -> None:
    """Register ``plan``, ``explain`` and ``diff`` on an argparse subparsers object."""
    p = sub.add_parser("plan", help="plan a model for a mesh: print the summary, write the plan JSON")
    p.add_argument("spec", help="config.json | model_type[:key=value,...] | package.module:factory")
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. 8x8 (axis 0 outermost: across nodes)")
    p.add_argument("--batch", type=int, required=True, help="global batch size")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (Hugging Face models and factories)")
    p.add_argument("--hardware", default="h100", help="a100 | h100 | h200 | cpu | a profile JSON path")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (the model's parameters and activations)")
    p.add_argument("--pp", default=None, help="pipeline groups: an integer, or auto to let the planner choose")
    p.add_argument("--memory-limit", default=None, help="bytes per device, e.g. 80GB (default: the hardware's)")
    p.add_argument("--optimizer", default="adamw", help="adamw | sgd | ... (its state counts toward memory)")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver seconds")
    p.add_argument("--out", default="plan.json", help="where to write the plan (JSON)")
    p.add_argument("--svg", default=None, help="also draw the plan here (.svg or .png)")
    p.add_argument("--layout", default=None, help="price this layout instead of searching, e.g. megatron:tp=8,pp=16 "
                   "or fsdp:tp=8,checkpoint=full (autoshard.layouts)")
    p.add_argument("--compare", default=None, metavar="LAYOUT",
                   help="also price LAYOUT and print it next to autoshard's plan (step, memory, MFU, exposed comm)")
    e = sub.add_parser("explain", help="why a plan placed a parameter or op as it did")
    e.add_argument("plan", help="a plan written by `autoshard plan` (or Plan.save, with --spec)")
    e.add_argument("name", help="a parameter name (model.named_parameters()) or an op node name")
    e.add_argument("--spec", default=None, help="the model SPEC, when the plan file does not record it")
    e.add_argument("--batch", type=int, default=None)
    e.add_argument("--seq", type=int, default=None)
    e.add_argument("--dtype", default=None)
    e.add_argument("--top", type=int, default=5, help="how many of the next-best strategies to show")
    d = sub.add_parser("diff", help="what differs between two plans")
    d.add_argument("a")
    d.add_argument("b")


@fewer_gc_pauses  # the whole command: importing torch and transformers and building the model collect too
def run(args: argparse.Namespace) -> int:
    """Run ``plan``, ``explain`` or ``diff``; returns the exit status. The garbage collector runs less
    often meanwhile (``passes.gc_pauses``): the imports and the model build made ~1,000 collections, 7 of
    them full walks of every object, ~1.2 of the CLI's ~20 CPU s on Llama-3 8B."""
    if args.command == "plan":
        return _plan(args)
    if args.command == "explain":
        return _explain(args)
    return _diff(args)


def _plan(args: argparse.Namespace) -> int:
    import autoshard.api
    from autoshard.layout_compare import compare_table, row_of
    from autoshard.layouts import parse as parse_layout
    from autoshard.model_specs import build_model
    from autoshard.passes.mesh import Mesh

    mesh = Mesh.of(parse_mesh(args.mesh))
    limit = parse_bytes(args.memory_limit)
    pp = None if args.pp is None else ("auto" if args.pp == "auto" else int(args.pp))
    start = time.perf_counter()
    with Progress("autoshard plan") as progress:
        progress.stage("building the model")
        built = build_model(args.spec, batch=args.batch, seq=args.seq, dtype=args.dtype)
        built_at = time.perf_counter()
        progress.stage("tracing and solving")
        common = dict(example_inputs=built.example_inputs, loss_fn=built.loss_fn, example_target=built.example_target,
                      hardware=args.hardware, memory_limit=limit, optimizer=args.optimizer, time_limit_s=args.time_limit)
        layout = parse_layout(args.layout) if args.layout else None
        plan = autoshard.api.plan(built.model, mesh, pp=pp, layout=layout, **common)
        theirs = None
        if args.compare:
            compared = parse_layout(args.compare)
            progress.stage(f"pricing {compared.describe()}")
            theirs = autoshard.api.plan(built.model, mesh, layout=compared, **common)
    plan.source = {**built.source, "memory_limit": limit, "optimizer": args.optimizer}
    n_params = sum(t.numel() for t in built.model.parameters())
    print(f"{built.description}: {_count(n_params)} parameters, global batch {args.batch}, seq {args.seq}, "
          f"{args.dtype}; planned in {time.perf_counter() - start:.1f} s (the model built in {built_at - start:.1f} s, "
          f"its first import of the model's library included; traced and solved in {time.perf_counter() - built_at:.1f} s)")
    print(plan.summary())
    if theirs is not None:
        print(f"\nside by side, priced by the same cost model; ratios over {compared.describe()}:")
        print(compare_table([(args.layout or "autoshard", row_of(plan)), (args.compare, row_of(theirs))]))
    plan.save(args.out)
    print(f"plan written to {args.out}")
    if args.svg:
        try:
            print(f"drawn to {plan.render(args.svg)}")
        except RuntimeError as e:
            print(e)
    return 0


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _load_plain(path: str):
    from autoshard.passes.errors import PlanFormatError
    from autoshard.plans import load_plan
    plan = load_plan(path)
    if plan.pipelined:
        raise PlanFormatError(f"{path} holds a pipelined plan; explain and diff read plans without a pipeline (plan "
                              "without --pp, or explain one stage's plan from Python: plan.stages[i].solution)")
    return plan


def _explain(args: argparse.Namespace) -> int:
    from autoshard.explain import explain, format_explanation
    from autoshard.model_specs import build_model
    from autoshard.passes.capture.export import capture
    from autoshard.passes.errors import PlanFormatError

    plan = _load_plain(args.plan)
    source = dict(plan.source or {})
    for key in ("spec", "batch", "seq", "dtype"):
        if getattr(args, key) is not None:
            source[key] = getattr(args, key)
    if "spec" not in source or "batch" not in source:
        raise PlanFormatError(f"{args.plan} does not record how its model was built (it was not written by "
                              "`autoshard plan`): pass --spec SPEC --batch B [--seq S] [--dtype D]")
    with Progress("autoshard explain") as progress:
        progress.stage("building and tracing the model")
        built = build_model(source["spec"], batch=source["batch"], seq=source.get("seq", 2048),
                            dtype=source.get("dtype", "fp32"))
        captured = capture(built.model, built.example_inputs, loss_fn=built.loss_fn, target=built.example_target,
                           stack_traces=False)
        plan = plan.attach(captured, plan.mesh)
        progress.stage("pricing the alternatives")
        result = explain(plan, args.name)
    print(format_explanation(result, args.name, top=args.top))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from autoshard.plan_diff import plan_diff
    print(plan_diff(_load_plain(args.a), _load_plain(args.b), args.a, args.b))
    return 0
