"""Every Hugging Face zoo model priced through ``autoshard.plan(layout=...)`` with five published
layouts on a (2, 2) mesh: does the layouts API hold on architectures no layout test names?

    python benchmarks/zoo_layouts.py [--only vit,qwen2_moe]

Prints one line per (model, layout): ``ok`` with the estimated step, ``refused`` with the
``AutoshardError`` (a clear refusal: the layout cannot run on that model, and the message says why),
or ``CRASH`` with any other exception (a bug). The zoo's models are tiny (``autoshard.testing.hf_zoo``),
so each plan takes seconds.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import autoshard
from autoshard import layouts
from autoshard.testing.hf_zoo import ZOO

LAYOUTS = {
    "fsdp": layouts.fsdp(),
    "fsdp(tp=2)": layouts.fsdp(tp=2),
    "megatron(tp=2)": layouts.megatron(tp=2, recompute="none"),
    "megatron(tp=2, pp=2)": layouts.megatron(tp=2, pp=2, recompute="none"),
    "fsdp(pp=2)": layouts.fsdp(pp=2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(sorted(ZOO)))
    args = ap.parse_args()
    counts = {"ok": 0, "refused": 0, "CRASH": 0}
    for name in args.only.split(","):
        for tag, layout in LAYOUTS.items():
            torch.manual_seed(0)
            model, inputs, target, loss_fn = ZOO[name]()
            t = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # batch-coupling warnings of MoE routing under pp
                    plan = autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss_fn,
                                          example_target=target, hardware="h100", layout=layout)
                outcome, text = "ok", f"step {plan.estimated_step_time * 1e3:.2f} ms"
            except autoshard.AutoshardError as e:
                outcome, text = "refused", f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001  a crash is what this sweep looks for
                outcome, text = "CRASH", f"{type(e).__name__}: {e}"
            counts[outcome] += 1
            print(f"{name:<20} {tag:<22} {outcome:<8} {time.perf_counter() - t:5.1f} s  {text[:240]}", flush=True)
    print(f"\n{counts['ok']} ok, {counts['refused']} refused, {counts['CRASH']} crashed")


if __name__ == "__main__":
    main()
