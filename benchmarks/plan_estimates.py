"""Estimates of a fixed set of plans, for checking that a refactor changes no price and no plan.

    python benchmarks/plan_estimates.py > before.txt   # on the old commit
    python benchmarks/plan_estimates.py > after.txt    # on the new one; diff the two

Plans GPT, Hugging Face Llama and a CNN (solved on (2, 2), (4,), (2, 2, 2), and three random plans
with random levers each), one attention layer with ring and Ulysses pins on (4,) and (2, 2), and
Mixtral's MoE layers pinned expert parallel, all on the h100 preset, then pipelines (``plan(pp=2)``:
the pipeline GPT on (4,) under 1f1b, zb-h1 and interleaved-1f1b and on (2, 2), and HF Llama on (4,)),
and prints per plan the estimated step time and memory (repr, every digit), a hash of the plan's JSON
(``h``, which a change of the file format alone changes) and a hash of its decisions alone (``d``: per
stage its ops, rank group, ranks, submesh, recompute and Solution; the schedule and microbatch count),
which only a changed plan changes. Both hashes leave out the wall-clock seconds a plan records of its
own search (``CLOCK_KEYS``: the solver's and the pipeline search's timings, which differ run to run), so
two runs of the same code print the same bytes. ``--dump DIR`` also writes each plan's JSON (clock
fields removed) to ``DIR/<tag>.json``, to diff a plan whose hash changed. About 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.testing import models
from autoshard.testing.models import PIPELINE_BUILDERS
from autoshard.testing.hf_zoo import build
from autoshard.testing.long_context import cp_pins, seq_attention
from autoshard.testing.moe_check import expert_pins


#: keys of wall-clock seconds in a plan's JSON (the solver's stats and the pipeline search's, nested);
#: ``work_s`` (deterministic solver work) is not one of them and stays
CLOCK_KEYS = frozenset({"wall_s", "solve_s", "plan_wall_s", "quick_s", "rank_s", "thorough_s"})

_DUMP = None


def without_clock(obj):
    """``obj`` (JSON data) with every ``CLOCK_KEYS`` entry removed, at any depth."""
    if isinstance(obj, dict):
        return {k: without_clock(v) for k, v in obj.items() if k not in CLOCK_KEYS}
    if isinstance(obj, (list, tuple)):
        return [without_clock(v) for v in obj]
    return obj


def _hash(obj) -> str:
    return hashlib.sha1(json.dumps(without_clock(obj), sort_keys=True, default=str).encode()).hexdigest()[:12]


def decisions(plan) -> list:
    """The plan's decisions whatever its type: its Solution when it has one stage (or none), else one
    entry per stage, then the schedule and microbatch count."""
    stages = getattr(plan, "stages", None) or []
    if len(stages) <= 1:
        return [plan.solution.to_json()]
    out = [[s.nodes, s.group, s.ranks, list(s.mesh.shape), bool(s.recompute), s.solution.to_json()] for s in stages]
    if len(stages) > 1:
        out.append([plan.schedule, plan.microbatches])
    return out


def show(tag: str, plan) -> None:
    print(f"{tag:40s} t={plan.estimated_step_time!r} mem={plan.estimated_memory!r} "
          f"h={_hash(plan.to_json())} d={_hash(decisions(plan))}", flush=True)
    if _DUMP:
        name = "".join(c if c.isalnum() or c in "=-" else "_" for c in tag)
        with open(os.path.join(_DUMP, name + ".json"), "w") as f:
            json.dump(without_clock(plan.to_json()), f, sort_keys=True, indent=1, default=str)


def main() -> None:
    global _DUMP
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump", metavar="DIR", help="also write each plan's JSON, clock fields removed, here")
    _DUMP = parser.parse_args().dump
    if _DUMP:
        os.makedirs(_DUMP, exist_ok=True)
    torch.manual_seed(0)
    for name, ctor in (("gpt", lambda: models.gpt(d=64, n_layer=2, seq=32)), ("llama", models.hf_llama),
                       ("cnn", models.cnn)):
        model, inputs, target, loss = ctor()
        for mesh in ((2, 2), (4,), (2, 2, 2)):
            show(f"{name} {mesh}", autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss,
                                                  example_target=target, hardware="h100", time_limit_s=20))
        for seed in (0, 1, 2):
            show(f"{name} random{seed}", autoshard.plan(model, (2, 2), example_inputs=inputs, loss_fn=loss,
                                                        example_target=target, hardware="h100", random_seed=seed))
    model, inputs, target, loss = seq_attention(seq=64)
    captured = capture(model, inputs, loss_fn=loss, target=target)
    for mesh in ((4,), (2, 2)):
        for mode in ("ring", "ulysses"):
            show(f"attn {mode} {mesh}", plan_captured(captured, mesh, hardware="h100", pins=cp_pins(mesh, mode),
                                                      time_limit_s=20))
    model, inputs, target, loss = build("mixtral")
    captured = capture(model, inputs, loss_fn=loss, target=target)
    for roles, mesh in ((("ep",), (4,)), (("ep_local",), (4,)), (("ep", "dp"), (2, 2))):
        show(f"mixtral {roles} {mesh}", plan_captured(captured, mesh, hardware="h100",
                                                      pins=expert_pins(captured, roles), time_limit_s=20))
    show("mixtral free (4,)", plan_captured(captured, (4,), hardware="h100", time_limit_s=20))
    model, inputs, target, loss, _ = PIPELINE_BUILDERS["gpt"]()
    for schedule, mesh in (("1f1b", (4,)), ("zb-h1", (4,)), ("interleaved-1f1b", (4,)), ("1f1b", (2, 2))):
        show(f"gpt pp=2 {schedule} {mesh}", autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss,
                                                           example_target=target, hardware="h100", pp=2,
                                                           schedule=schedule, time_limit_s=20))
    model, inputs, target, loss = models.hf_llama()
    show("llama pp=2 (4,)", autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss, example_target=target,
                                           hardware="h100", pp=2, time_limit_s=20))


if __name__ == "__main__":
    main()
