"""Cost-model fidelity: the plan's estimated step time against the measured one, for many layouts.

    python benchmarks/fidelity.py [--rounds 7] [--iters 3] [--json out.json]   # starts torchrun 4 itself
    torchrun --nproc_per_node 4 benchmarks/fidelity.py

On 4 gloo ranks (CPU): first measures a profile of this machine with ``autoshard/profiling/measure.py`` (all 4
ranks busy, as in the steps that follow) and writes it to a JSON file; then compiles the GPT example's
model (``autoshard.testing.models.GPT`` with fused qkv: op for op examples/nanogpt.py's) under pinned
layouts -- data parallel, FSDP, Megatron TP, their mixes on (4,) and (2, 2), and the solver's own
choice -- at several widths and batch sizes, each planned with ``hardware=<that profile>``. A step
is ``cm.step`` (forward + backward + gradient sync; the optimizer is not part of the estimate and is
not run). Steps are timed in rounds that visit every
layout once, in a fresh shuffled order each round (the same on every rank), so load that comes and
goes on a shared machine spreads over all layouts instead of hitting the same ones; the figure is
the median over rounds. The model is fitted only on the profile's micro-benchmarks, never on these
runs. ``--profile-after`` measures the profile again after the steps and prices with both pooled.

Prints a table (predicted, measured, error = predicted / measured - 1, and the plan's priced breakdown:
compute, host, communication, gradient sync, recompute), the Spearman rank correlation, the median |error| and the machine's load average (``os.getloadavg``) before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from autoshard.passes.solve.context import PlanContext

#: (label, mesh, layout, width d, global batch); layouts: dp, fsdp, tp (Megatron on the last axis,
#: data parallel on the others), solver (no pins)
CASES = (
    ("DP", (4,), "dp", 64, 16),
    ("FSDP", (4,), "fsdp", 64, 16),
    ("TP", (4,), "tp", 64, 16),
    ("DP", (4,), "dp", 256, 32),
    ("FSDP", (4,), "fsdp", 256, 32),
    ("TP", (4,), "tp", 256, 32),
    ("DP", (4,), "dp", 128, 64),
    ("TP", (4,), "tp", 512, 16),
    ("DP", (2, 2), "dp", 128, 16),
    ("FSDP", (2, 2), "fsdp", 128, 16),
    ("DP x TP", (2, 2), "tp", 128, 16),
    ("DP x TP", (2, 2), "tp", 384, 32),
    ("solver", (2, 2), "solver", 256, 32),
    ("solver", (4,), "solver", 512, 64),
)


#: the plan's time breakdown (``Solution.time_breakdown``) printed beside each row's error
PRICED = {"compute": "compute", "host": "host", "communication": "comm", "grad_sync": "grad sync",
          "recompute": "recompute"}


def spearman(xs, ys) -> float:
    """Spearman rank correlation (ties get their average rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _load(avg) -> str:
    return "/".join(f"{v:.1f}" for v in avg)


def _pins(layout, model, mesh, n_layer):
    import autoshard
    if layout == "dp":
        return autoshard.presets.data_parallel(mesh)
    if layout == "fsdp":
        return autoshard.presets.fully_sharded(model, mesh)
    if layout == "tp":
        return autoshard.presets.megatron_mlp(
            model, [f"blocks.{i}.{n}" for i in range(n_layer) for n in ("qkv", "fc")],
            [f"blocks.{i}.{n}" for i in range(n_layer) for n in ("o", "out")], mesh)
    return {}


def _collective_counts(cm) -> tuple[int, int]:
    """(forward collectives the plan prices, collective calls in the emitted forward program), both
    without local chunks, gradient syncs and the loss's reduction (the executor's, outside the
    program): a check that the cost model charges what runs."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    plan = sum(1 for r in cm.plan.solution.redistributions if r.consumer != "output"
               for c in r.collectives if c.phase == "fwd")
    program = sum(v for k, v in cm.collective_counts().items() if k in kinds)
    return plan, program


def _estimate(plan, profile: str):
    """Re-price the plan that ran (the same strategy for every op) with ``profile``: (seconds, breakdown)."""
    from autoshard.passes.solve.solution import evaluate
    sol = evaluate(plan.captured, plan.mesh, plan.solution.strategies, PlanContext.of(profile))
    return sol.estimated_step_time, dict(sol.time_breakdown)


def run(args) -> None:
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.passes.cost.profile_format import merge_profiles
    from autoshard.profiling.measure import ProfileConfig, measure_profile
    from autoshard.testing.corpus import CharData, generate_corpus
    from autoshard.testing.models import GPT, lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    config = ProfileConfig.make(quick=args.quick_profile)
    prof = measure_profile(config, name="fidelity-cpu")
    if rank == 0:
        with open(args.profile, "w") as f:
            json.dump(prof, f)
    dist.barrier()
    t_prof = time.perf_counter() - t0
    data = CharData(generate_corpus())
    compiled, plans, counts = [], [], []
    for label, mesh, layout, d, batch in CASES:
        if rank == 0:
            print(f"compiling {label} {mesh} d={d} batch={batch}", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        model = GPT(vocab=data.vocab, d=d, n_layer=2, n_head=4, seq=32, fused_qkv=True)
        x, y = data.batch(batch, 32, step=0)
        cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                               hardware=args.profile, **_pins(layout, model, mesh, 2))
        params = list(cm.parameters())

        def step(cm=cm, x=x, y=y, params=params):
            cm.step(x, target=y)
            for p in params:
                p.grad = None
        for _ in range(2):
            step()
        compiled.append((step, cm.plan.solution.estimated_step_time, dict(cm.plan.solution.time_breakdown)))
        plans.append(cm.plan)
        counts.append(_collective_counts(cm))
    times = [[] for _ in compiled]
    order = list(range(len(compiled)))
    for r in range(args.rounds):
        random.Random(r).shuffle(order)  # seeded: every rank visits the layouts in the same order
        for k in order:
            step = compiled[k][0]
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.iters):
                step()
            dist.barrier()
            times[k].append((time.perf_counter() - t) / args.iters)
    if args.profile_after:  # a second profile after the steps; plans are priced again with both pooled
        t0 = time.perf_counter()
        later = measure_profile(config, name="fidelity-cpu")
        t_prof += time.perf_counter() - t0
        if rank == 0:
            with open(args.profile, "w") as f:
                json.dump(merge_profiles(prof, later), f)
        dist.barrier()
        for k, plan in enumerate(plans):
            compiled[k] = (compiled[k][0], *_estimate(plan, args.profile))
    if rank == 0:
        rows = []
        for (label, mesh, layout, d, batch), (_, pred, parts), ts, (n_plan, n_prog) in zip(CASES, compiled, times, counts):
            meas = statistics.median(ts)
            rows.append({"layout": label, "mesh": list(mesh), "d": d, "batch": batch, "predicted_s": pred,
                         "collectives_plan": n_plan, "collectives_program": n_prog, "priced": parts,
                         "measured_s": meas, "error": pred / meas - 1.0})
        rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
        med = statistics.median(abs(r["error"]) for r in rows)
        load_after = os.getloadavg()
        print(f"GPT example (2 layers, seq 32), {world} gloo ranks on {os.cpu_count()} cores; profile measured "
              f"in the same run ({t_prof:.1f} s); {args.rounds} shuffled rounds x {args.iters} steps, medians; "
              f"load average (1, 5, 15 min) before {_load(load_before)}, after {_load(load_after)}")
        keys = [k for k in PRICED if any(r["priced"].get(k) for r in rows)]
        print("| layout | mesh | d | batch | collectives plan/program | predicted ms | measured ms | error | "
              + " | ".join(f"priced {PRICED[k]} ms" for k in keys) + " |\n|" + "---|" * (8 + len(keys)))
        for r in rows:
            print(f"| {r['layout']} | {tuple(r['mesh'])} | {r['d']} | {r['batch']} | "
                  f"{r['collectives_plan']}/{r['collectives_program']} | {r['predicted_s'] * 1e3:.2f} | "
                  f"{r['measured_s'] * 1e3:.2f} | {r['error'] * 100:+.1f}% | "
                  + " | ".join(f"{r['priced'].get(k, 0.0) * 1e3:.2f}" for k in keys) + " |")
        print(f"Spearman rank correlation {rho:.3f}; median |error| {med * 100:.1f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "spearman": rho, "median_abs_error": med, "profile_seconds": t_prof,
                           "rounds": args.rounds, "iters": args.iters, "world": world}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--quick-profile", action="store_true", help="measure the profile with --quick settings")
    ap.add_argument("--profile", default=os.path.join(tempfile.gettempdir(), "autoshard_fidelity_profile.json"),
                    help="where the measured profile is written")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    ap.add_argument("--profile-after", action="store_true",
                    help="measure the profile again after the steps and price with both pooled (load drift)")
    args = ap.parse_args()
    relaunch_under_torchrun(__file__, args.nproc)
    run(args)


def relaunch_under_torchrun(script: str, nproc: int) -> None:
    """Outside torchrun, run ``script`` again under it on ``nproc`` local ranks (same arguments) and
    exit with its status; under torchrun, return."""
    if "WORLD_SIZE" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               os.path.abspath(script), *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
