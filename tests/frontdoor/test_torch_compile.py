"""``autoshard.compile(..., compile=True)``: each rank's program through ``torch.compile`` with inductor.

- On 2 gloo ranks, the small GPT fully sharded with every block checkpointed and resharded after
  forward (parameter gathers between regions, prefetch, recompute), through inductor: two compiled
  steps equal one device within the measured noise floor (``NoiseFloor``, plain SGD as in the zoo check); every compiled
  region compiled without a graph break, the second step compiles nothing, the summary says so.
  A second case reshards without checkpointing (AOTAutograd without code generation): the copies
  compiled regions save for backward are packed by the gatherer and gathered again (``regathered``).
- Another process compiling the same program with the same ``cache_dir`` loads inductor's compiled
  graphs from it: the inductor case's two ranks compile in turn (one at a time on a CPU host), so each
  distinct graph is compiled (an FX graph cache miss) by whichever rank reaches it first and loaded (a
  hit) by the other; with nothing shared between the processes, each rank would miss every graph it
  compiles. (A separate pair of processes compiling an MLP cost ~25 CPU s of C++ compiles for this.)
- A 2-stage pipeline (1F1B, and zero-bubble ZB-H1, which splits each backward into B and W) with
  each stage's program compiled trains as one device does: with AOTAutograd only (fast tier) and
  with inductor (slow tier).
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import autoshard
from autoshard.runtime.compiled_regions import CompiledRegion
from autoshard.testing.equivalence import compiled_gradient_mismatches, failures_of, train_against_one_device
from autoshard.testing.levers import build
from autoshard.testing.ranks import run_ranks
from autoshard.testing.zoo_check import TOL, sgd


def _worker(rank: int, world: int, levers: dict, backend: str, cache_dir=None) -> tuple:
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(8, 0)
    ref = copy.deepcopy(model)
    cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                           hardware="cpu", compile=autoshard.CompileOptions(backend=backend, cache_dir=cache_dir),
                           **autoshard.presets.fully_sharded(model, (world,)), **levers)
    failures = train_against_one_device(f"gpt {levers}", cm, ref, (inputs, target), loss_fn=loss_fn, steps=1,
                                        optimizer=sgd, tol=TOL, gradients=compiled_gradient_mismatches)
    report = cm.compile_report
    compiles = report.stats.compiles
    cm.step(*inputs, target=target)
    regions = [m for m in cm.program.modules() if isinstance(m, CompiledRegion)]
    return (failures, len(regions), [r.stats.compiles for r in regions], sum(report.graph_breaks.values()),
            report.stats.compiles - compiles, cm._program.gatherer.regathered, cm.plan.summary(),
            (report.stats.cache_hits, report.stats.cache_misses))


def test_compiled_steps_equal_one_device_with_checkpointing_and_resharding(tmp_path):
    # inductor once (checkpointing and resharding together); the saved copies' packing depends on AOTAutograd's
    # saved tensors, not on the code generated, so that case runs without code generation
    cache = tmp_path / "cache"
    for levers, backend in (({"checkpoint": "full", "reshard_after_forward": True}, "inductor"),
                            ({"reshard_after_forward": True}, "aot_eager")):
        results = run_ranks(_worker, 2, levers, backend, str(cache) if backend == "inductor" else None,
                            timeout=1200)
        assert not failures_of([r[0] for r in results]), failures_of([r[0] for r in results])
        if backend == "inductor":
            _assert_each_graph_compiled_once_and_loaded_by_the_other_rank([r[-1] for r in results], cache)
        for failures, regions, compiles, breaks, recompiles, regathered, summary, _ in results:
            assert regions >= 3 and all(c == 1 for c in compiles), (levers, compiles)  # each region compiled once
            assert breaks == 0 and recompiles == 0, levers
            if "checkpoint" not in levers:  # saved copies packed as handles, gathered again for the backward
                assert regathered > 0, levers  # (a checkpointed block gathers again when it recomputes)
            assert f"compiled (torch.compile, {backend})" in summary and "graph breaks 0" in summary
            assert re.search(r"eager between regions: \d x parameter gathers", summary), summary


def _assert_each_graph_compiled_once_and_loaded_by_the_other_rank(stats: list, cache) -> None:
    """``stats``: each rank's (FX graph cache hits, misses) over the same program, compiled in turn with one
    ``cache_dir``. A working cache compiles each of the program's ``D`` distinct graphs once in all
    (``D`` misses, however the turns interleave) and loads the rest: ``2 N - D`` hits, ``N`` a rank's
    lookups. Were the cache not shared between the processes, each rank would miss its ``D``: ``2 D`` misses,
    more than ``N`` whenever most of a rank's graphs are distinct (as here: a GPT's blocks repeat, little
    else does)."""
    (hits0, misses0), (hits1, misses1) = stats
    lookups = hits0 + misses0
    assert hits1 + misses1 == lookups and lookups >= 4, stats  # the same program: the same lookups
    assert misses0 + misses1 <= lookups and hits0 + hits1 >= lookups, stats  # each graph compiled once in all
    assert cache.is_dir() and any(cache.iterdir()), "the compiles did not use cache_dir"


def _pipeline_worker(rank: int, world: int, backend: str) -> list:
    torch.set_num_threads(1)
    failures = []
    for schedule in ("1f1b", "zb-h1"):  # zb-h1 splits each backward into B and W
        torch.manual_seed(0)
        model, batch, loss_fn, _ = build("gpt")
        inputs, target = batch(8, 0)
        ref = copy.deepcopy(model)
        cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", pp=2, schedule=schedule, microbatches=2,
                               compile=autoshard.CompileOptions(backend=backend))
        failures += train_against_one_device(f"pp=2 {schedule} {backend}", cm, ref, (inputs, target), loss_fn=loss_fn,
                                             steps=2, optimizer=sgd, tol=TOL)
        report = cm.compile_report
        regions = [r for st in cm._program.stages.values() for r in st.program.modules() if isinstance(r, CompiledRegion)]
        if not regions or any(not r.stats.compiles for r in regions) or sum(report.graph_breaks.values()):
            failures.append(f"pp=2 {schedule}: regions {[r.stats.compiles for r in regions]}, "
                            f"breaks {dict(report.graph_breaks)}")
        if f"compiled (torch.compile, {backend})" not in cm.plan.summary():
            failures.append(f"pp=2 {schedule}: the summary does not say what was compiled")
    return failures


def test_pipeline_stages_compiled_aot_eager():
    """Each stage's program through torch.compile (AOTAutograd, no code generation: quick), sends and
    receives outside; 1F1B and zero-bubble schedules train as one device does."""
    failures = failures_of(run_ranks(_pipeline_worker, 2, "aot_eager", timeout=900))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_pipeline_stages_compiled_inductor():
    failures = failures_of(run_ranks(_pipeline_worker, 2, "inductor", timeout=1800))
    assert not failures, "\n".join(failures)
