"""Run the Hugging Face zoo through autoshard on gloo ranks and say, per architecture, what happened.

    table = run_zoo(["llama", "bert"])                               # {"llama": ZooResult(...), ...}
    assert all(r.status == "ok" for r in table.values())

For each model (built by ``autoshard.testing.hf_zoo``): capture the training step, once, in the process
the ranks fork from (``run_zoo``: ``run_ranks(prepare=zoo_captures)``; ``zoo_worker`` captures on every
rank, seeded identically, as four ranks each capturing the same model did before); every case ``(mesh, seed)`` of every model is planned once (``seed`` None: the solver,
else a random valid plan drawn with that seed), the cases spread over the ranks
(``shared_work.spread_over_ranks``); then every rank compiles each plan and trains it next to a
single-device copy (``equivalence.train_against_one_device``: the loss every step, the first step's
local gradients and the full state dict at the end). A failure at any stage (capture, the float64
premise, plan, compile, train) is caught and recorded with its stage and message, so one model's bug
never hides another's result. Capture times are rank 0's, plan times those of the rank that planned.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from autoshard.testing.equivalence import NoiseFloor, Tolerance, compiled_gradient_mismatches, train_against_one_device
from autoshard.testing.hf_zoo import build
from autoshard.testing.shared_work import spread_over_ranks

__all__ = ["ZooResult", "CASES", "TOL", "FLOAT64_TOL", "run_zoo", "zoo_captures", "zoo_worker", "prepared_zoo_worker",
           "merge_results", "narrower_on_gradient_path"]

#: (mesh, seed): the solver's plan on a 2-D mesh, random plans on both meshes.
CASES: tuple = (((2, 2), None), ((4,), 1), ((2, 2), 2))
STEPS = 2
#: float32 runs: within 16x the one-device float32 run's own distance from float64 (``noise_floor.py``);
#: models with an op that has no float64 kernel (grouped-GEMM MoE) keep the fixed tolerance used before.
TOL = NoiseFloor(fallback=Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-6))
#: float64 runs: rounding is ~1e-16 relative, so anything past 1e-9 is a real difference.
FLOAT64_TOL = Tolerance(rtol=1e-9, atol=1e-10, grad_atol=1e-10)


def sgd(params):
    """Plain SGD: an update proportional to the gradient. Adam would turn the rounding noise of gradients
    that are exactly zero in exact arithmetic (an attention key bias: softmax ignores a per-query shift)
    into full-size updates; the first step's gradients are compared directly instead."""
    return torch.optim.SGD(params, lr=0.1)


@dataclass
class ZooResult:
    """One architecture's outcome: ``status`` "ok" or "<stage> failed" (capture, plan, compile, train);
    ``failures``: what differed or raised; timings in seconds (rank 0); ``unruled``: ops with no rule."""
    name: str
    status: str = "ok"
    failures: list = field(default_factory=list)
    capture_s: float = 0.0
    plan_s: dict = field(default_factory=dict)
    unruled: list = field(default_factory=list)
    replicated_cost: list = field(default_factory=list)
    noise_ratios: list = field(default_factory=list)  # (quantity, distance / float32 floor) with a ratios list


def narrower_on_gradient_path(captured, dtype: torch.dtype) -> list[str]:
    """The ops of ``captured`` on a trained parameter's gradient path (reached from a parameter's
    placeholder) whose floating-point output is narrower than ``dtype``, as ``"name (target -> dtype)"``.

    A float64 comparison with one device holds to ~1e-16 only where the model computes in float64: a
    model that casts to float32 on the way (Mixtral's router softmax, Hugging Face's RMSNorm) rounds to
    float32 there, and a plan that splits the work rounds at other points (a partial gradient cast to
    float32 per rank, then summed), so the two sides legitimately differ by float32 ulps. Ops reached
    only from buffers and inputs (rotary tables computed in float32) are not on a gradient path."""
    params = set(captured.params)
    reached, out = set(params), []
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder" or not any(a.name in reached for a in node.all_input_nodes):
            continue
        reached.add(node.name)
        val = node.meta.get("val")
        narrow = sorted({str(v.dtype) for v in (val if isinstance(val, (tuple, list)) else [val])
                         if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize < dtype.itemsize})
        if narrow and node.op == "call_function":
            out.append(f"{node.name} ({node.target} -> {', '.join(narrow)})")
    return out


def _case_label(name: str, mesh, seed) -> str:
    return f"{name} mesh={mesh} " + ("solver" if seed is None else f"random(seed={seed})")


def _to_dtype(value, dtype: torch.dtype):
    """``value`` (a tensor, or a tuple/list/dict of them) with its floating-point tensors cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to_dtype(v, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    return value


def zoo_captures(names: Sequence[str], dtype: torch.dtype = torch.float32,
                 setup: Optional[Callable[[], None]] = None) -> list:
    """Every model of ``names`` built (``torch.manual_seed(0)`` first), cast to ``dtype`` and captured, in
    order: ``[(ZooResult, (model, inputs, target, loss_fn, captured) or None when it failed), ...]``.
    ``setup()`` runs first (a patch the run needs, e.g. ``test_hf_zoo_float64``'s). A model that computes
    narrower than float64 on a gradient path (``narrower_on_gradient_path``) fails at stage "premise"
    under ``dtype=torch.float64``; any other exception at stage "capture"."""
    from autoshard.passes.capture.export import capture

    if setup is not None:
        setup()
    torch.set_num_threads(1)
    out = []
    for name in names:
        result, built = ZooResult(name), None
        try:
            torch.manual_seed(0)
            model, inputs, target, loss_fn = build(name)
            model, inputs, target = model.to(dtype), _to_dtype(inputs, dtype), _to_dtype(target, dtype)
            t0 = time.perf_counter()
            captured = capture(model, inputs, loss_fn=loss_fn, target=target)
            result.capture_s = time.perf_counter() - t0
            if dtype == torch.float64:
                narrow = narrower_on_gradient_path(captured, dtype)
                if narrow:
                    raise _Premise(f"{name} computes narrower than float64 on a gradient path, so a float64 "
                                   f"comparison there holds only to float32 rounding: {', '.join(narrow[:6])}"
                                   f"{' ...' if len(narrow) > 6 else ''}; make those ops compute in the input's "
                                   f"dtype for this run (as test_hf_zoo_float64 does for RMSNorm) or leave the "
                                   f"model out of the float64 sweep")
            built = (model, inputs, target, loss_fn, captured)
        except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others'
            _failed(result, "premise" if isinstance(e, _Premise) else "capture", e)
        out.append((result, built))
    return out


def run_zoo(names: Sequence[str], world: int = 4, *, cases: Sequence = CASES, steps: int = STEPS,
            time_limit_s: float = 20.0, dtype: torch.dtype = torch.float32, tol: Union[Tolerance, NoiseFloor] = TOL,
            setup: Optional[Callable[[], None]] = None, timeout: float = 900.0) -> dict[str, ZooResult]:
    """Every model of ``names`` through every case on ``world`` gloo ranks, one launch, merged
    (``merge_results``): the models captured once (``zoo_captures``, ``run_ranks``' ``prepare``), the
    ranks forked from that process; ``setup`` as in ``zoo_captures`` (the ranks inherit what it did)."""
    import functools

    from autoshard.testing.ranks import run_ranks
    return merge_results(run_ranks(prepared_zoo_worker, world, cases, steps, time_limit_s, tol, timeout=timeout,
                                   prepare=functools.partial(zoo_captures, list(names), dtype, setup)))


def zoo_worker(rank: int, world: int, names: Sequence[str], cases: Sequence = CASES, steps: int = STEPS,
               time_limit_s: float = 20.0, dtype: torch.dtype = torch.float32,
               tol: Union[Tolerance, NoiseFloor] = TOL) -> list[ZooResult]:
    """Every model in ``names`` through every case on this rank, each captured here (``zoo_captures``);
    a ``ZooResult`` per model.

    ``dtype=torch.float64`` builds every model, input and target in double precision (with a matching
    ``tol``, e.g. ``FLOAT64_TOL``): there a correct plan agrees with one device to ~1e-12, so a
    difference is a bug, not rounding; a model that computes narrower on a gradient path
    (``narrower_on_gradient_path``) fails at stage "premise" instead of being compared."""
    return prepared_zoo_worker(rank, world, zoo_captures(names, dtype), cases, steps, time_limit_s, tol)


def prepared_zoo_worker(rank: int, world: int, captures: list, cases: Sequence = CASES, steps: int = STEPS,
                        time_limit_s: float = 20.0, tol: Union[Tolerance, NoiseFloor] = TOL) -> list[ZooResult]:
    """``zoo_worker`` for models already captured (``zoo_captures``' list, the same on every rank)."""
    from autoshard.compiled import CompiledModel
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    out, built, jobs = [], {}, []
    for result, made in captures:  # every case's plan job first, so that they can be spread over the ranks
        out.append(result)
        if made is not None:
            built[result.name] = made
        for mesh_shape, seed in cases:  # one job per case on every rank, captured or not: the same count
            jobs.append(_plan_job(made, mesh_shape, seed, time_limit_s))
    planned = iter(spread_over_ranks(jobs))  # each case planned once, on one rank
    for result in out:
        outcomes = [next(planned) for _ in cases]
        if result.name not in built:
            continue
        model, inputs, target, loss_fn, captured = built.pop(result.name)
        if isinstance(tol, NoiseFloor) and tol.ratios is not None:
            tol = dataclasses.replace(tol, ratios=result.noise_ratios)
        stage = "plan"
        try:
            for (mesh_shape, seed), outcome in zip(cases, outcomes):
                label = _case_label(result.name, mesh_shape, seed)
                mesh = Mesh.of(mesh_shape)
                env = setup_distributed(mesh)
                stage = "plan"
                got = outcome.value()
                result.plan_s[label] = got["seconds"]
                plan = Plan.from_json(got["plan"]).attach(captured, mesh)
                result.unruled = list(plan.replicated_ops)
                stage = "compile"
                cm = CompiledModel(model, plan, env)
                stage = "train"
                ref = copy.deepcopy(model)
                result.failures += train_against_one_device(
                    label, cm, ref, (inputs, target), loss_fn=loss_fn, steps=steps, tol=tol, optimizer=sgd,
                    gradients=compiled_gradient_mismatches)
                del cm, ref
                if result.failures:
                    result.status = "train failed"
                    break
        except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others'
            _failed(result, stage, e)
        del model, captured
    return out


class _Premise(ValueError):
    """A float64 model that computes narrower on a gradient path (``narrower_on_gradient_path``)."""


def _failed(result: ZooResult, stage: str, e: Exception) -> None:
    result.status = f"{stage} failed"
    last = traceback.format_exc().strip().splitlines()[-3:]
    result.failures.append(f"{result.name}: {stage} raised {type(e).__name__}: {str(e)[:500]} | {' / '.join(last)}")


def _plan_job(built, mesh_shape, seed, time_limit_s: float):
    """The job planning one case of a captured model (``built``); None when its capture failed."""
    def solve():
        if built is None:
            return None
        from autoshard.api import plan_captured
        from autoshard.passes.mesh import Mesh
        t = time.perf_counter()
        p = plan_captured(built[-1], Mesh.of(mesh_shape), hardware="cpu", random_seed=seed, time_limit_s=time_limit_s)
        return {"plan": p.to_json(), "seconds": time.perf_counter() - t}
    return solve


def merge_results(per_rank: list[list[ZooResult]]) -> dict[str, ZooResult]:
    """One result per model from every rank's: rank 0's timings, every rank's failures (each once);
    a model failed if it failed on any rank."""
    merged: dict[str, ZooResult] = {}
    for rank_results in per_rank:
        for r in rank_results:
            m = merged.setdefault(r.name, r)
            if m is r:
                continue
            m.failures += [f for f in r.failures if f not in m.failures]
            m.noise_ratios += r.noise_ratios
            if m.status == "ok" and r.status != "ok":
                m.status = r.status
    return merged
