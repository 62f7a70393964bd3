"""Where a fidelity row's error comes from: the plan's priced collectives against the ones a step runs.

    python benchmarks/fidelity_breakdown.py --profile /tmp/autoshard_fidelity_profile.json [--cases 1,2,5]

On 4 gloo ranks (CPU), with a profile ``benchmarks/fidelity.py`` wrote (or one measured here when
``--profile`` does not exist yet), compiles the chosen rows of ``fidelity.CASES`` and times steps
with every ``torch.distributed`` collective wrapped: per kind, the calls, bytes and seconds a step
spends inside them (an asynchronous call: its launch plus the time its ``wait()`` blocks). Prints,
per row, the plan's breakdown (compute, communication, gradient sync; priced calls and seconds per
kind) next to the measured one (calls and seconds per kind; the rest of the step counted as compute).
Rank 0's figures; the step is the median over ``--iters`` steps.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fidelity import CASES, _pins, relaunch_under_torchrun  # noqa: E402


class _Recorder:
    """Wraps the torch.distributed collectives the runtime calls; counts calls, bytes and seconds per kind."""

    NAMES = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
             "all_to_all_single": "all_to_all"}

    def __init__(self):
        self.on = False
        self.stats = collections.defaultdict(lambda: [0, 0, 0.0])  # kind -> [calls, bytes, seconds]

    def install(self):
        import torch.distributed as dist
        from autoshard.runtime import collectives as rc
        from autoshard.runtime import gradsync, executor
        self._undo = []
        for mod in (dist, rc, gradsync, executor):
            for attr in dir(mod):
                fn = getattr(mod, attr, None)
                name = getattr(fn, "__name__", None)
                # torch.distributed's own functions, and the runtime's private aliases of them (its
                # public ``all_reduce`` etc. are autograd wrappers that call those: not counted twice)
                if callable(fn) and name in self.NAMES and (attr.startswith("_") if mod is not dist else attr in self.NAMES):
                    self._undo.append((mod, attr, fn))
                    setattr(mod, attr, self._wrap(fn, self.NAMES[name]))

    def _wrap(self, fn, kind):
        rec = self

        class _Work:
            def __init__(self, work, row):
                self._work, self._row = work, row

            def wait(self, *a, **k):
                t = time.perf_counter()
                out = self._work.wait(*a, **k)
                self._row[2] += time.perf_counter() - t
                return out

            def __getattr__(self, item):
                return getattr(self._work, item)

        def wrapped(*args, **kwargs):
            if not rec.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            row = rec.stats[kind + (" async" if kwargs.get("async_op") else "")]
            row[0] += 1
            row[1] += max(a.numel() * a.element_size() for a in args if hasattr(a, "numel"))
            row[2] += time.perf_counter() - t
            return _Work(out, row) if kwargs.get("async_op") else out
        wrapped.__name__ = fn.__name__
        return wrapped


def _priced(cm) -> dict:
    """kind/phase -> [calls, seconds] the plan prices (redistributions and gradient syncs)."""
    out = collections.defaultdict(lambda: [0, 0.0])
    sol = cm.plan.solution
    for r in sol.redistributions:
        for c in r.collectives:
            out[f"{c.kind} {c.phase}"][0] += 1
            out[f"{c.kind} {c.phase}"][1] += c.seconds
    for colls in sol.param_grad_syncs.values():
        for c in colls:
            out["grad all_reduce"][0] += 1
            out["grad all_reduce"][1] += c.seconds
    return out


def run(args) -> None:
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.profiling.measure import ProfileConfig, measure_profile
    from autoshard.testing.corpus import CharData, generate_corpus
    from autoshard.testing.models import GPT, lm_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if not os.path.exists(args.profile):
        prof = measure_profile(ProfileConfig.make(), name="fidelity-cpu")
        if rank == 0:
            import json
            with open(args.profile, "w") as f:
                json.dump(prof, f)
        dist.barrier()
    data = CharData(generate_corpus())
    rec = _Recorder()
    rec.install()
    wanted = [int(i) for i in args.cases.split(",")] if args.cases else range(len(CASES))
    for idx in wanted:
        label, mesh, layout, d, batch = CASES[idx]
        torch.manual_seed(0)
        model = GPT(vocab=data.vocab, d=d, n_layer=2, n_head=4, seq=32, fused_qkv=True)
        x, y = data.batch(batch, 32, step=0)
        cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                               hardware=args.profile, **_pins(layout, model, mesh, 2))
        params = list(cm.parameters())

        def step():
            cm.step(x, target=y)
            for p in params:
                p.grad = None
        for _ in range(2):
            step()
        rec.stats.clear()
        times = []
        for _ in range(args.iters):
            dist.barrier()
            rec.on = True
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
            rec.on = False
        dist.barrier()
        if rank:
            continue
        sol = cm.plan.solution
        tb = sol.time_breakdown
        meas = statistics.median(times)
        comm = sum(v[2] for v in rec.stats.values()) / args.iters
        print(f"\n[{idx}] {label} {mesh} d={d} batch={batch}: predicted {sol.estimated_step_time * 1e3:.2f} ms "
              f"(compute {tb['compute'] * 1e3:.2f}, communication {tb['communication'] * 1e3:.2f}, grad sync "
              f"{tb['grad_sync'] * 1e3:.2f}, recompute {tb['recompute'] * 1e3:.2f}); measured {meas * 1e3:.2f} ms "
              f"(in collectives {comm * 1e3:.2f}, the rest {(meas - comm) * 1e3:.2f})")
        for kind, (n, s) in sorted(_priced(cm).items()):
            print(f"   priced   {kind:22s} {n:4d} calls {s * 1e3:8.3f} ms  ({s / max(n, 1) * 1e6:7.1f} us/call)")
        for kind, (n, b, s) in sorted(rec.stats.items()):
            n, b, s = n / args.iters, b / args.iters, s / args.iters
            print(f"   measured {kind:22s} {n:6.1f} calls {s * 1e3:8.3f} ms  ({s / max(n, 1) * 1e6:7.1f} us/call, "
                  f"{b / max(n, 1) / 1024:8.1f} KiB/call)")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--cases", default="", help="comma-separated row indices of fidelity.CASES (default: all)")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    relaunch_under_torchrun(__file__, args.nproc)
    run(args)


if __name__ == "__main__":
    main()
