"""``compile=True`` on gloo ranks against one device, per model and plan: the harness of the slow compile
sweep (``tests/frontdoor/test_torch_compile_sweep.py``) and of ``benchmarks/compile_exactness.py``.

    results = run_ranks(compile_worker, 4, CASES)     # one spawn for every case
    for r in results[0]: print(r.label, r.failures, r.worst_ratio)

Each case ``(model, seed[, backend])``: the model (``MODELS``) seeded alike on every rank, planned once on
mesh (2, 2) (``seed`` None: the solver, else a random valid plan), every block checkpointed ("full") and
resharded after forward: ``autoshard.plan`` with the options ``compile`` would plan with, the cases spread
over the ranks (``shared_work.spread_over_ranks``; rank 0 planned every case while three ranks waited), the
plans shared as JSON. Every rank then runs ``autoshard.compile(..., plan=)`` with
``CompileOptions(backend=backend)`` (default inductor) and trains it next to a
single-device copy (``equivalence.train_against_one_device``: the loss of each step, the first step's
local gradients and the final state, within ``zoo_check.TOL``'s measured noise floor, plain SGD). Then
every compiled region must have compiled, and the models in ``NO_BREAKS`` without a graph break.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from autoshard.testing.equivalence import NoiseFloor, compiled_gradient_mismatches, train_against_one_device
from autoshard.testing.shared_work import spread_over_ranks
from autoshard.testing.zoo_check import TOL, sgd

__all__ = ["MODELS", "CASES", "NO_BREAKS", "CompileResult", "compile_worker"]

#: the GPT, an HF Llama, a BatchNorm CNN (statistics synchronized across ranks) and an HF Mixtral
MODELS = ("gpt", "hf_llama", "cnn", "mixtral")
#: each model under the solver's plan and a random plan, ``(name, seed, backend)``: AOTAutograd without code
#: generation (``aot_eager``: dynamo's capture, the functional collectives and the joint graph's autograd,
#: which is what decides exactness), except the GPT under the solver's plan, through inductor (its C++
#: kernels; inductor takes minutes per model on a loaded 2-core machine, so one case carries it)
CASES = tuple((name, seed, "inductor" if (name, seed) == ("gpt", None) else "aot_eager")
              for name in MODELS for seed in (None, 5))
#: models whose compiled regions must compile without a graph break
NO_BREAKS = ("gpt", "hf_llama")


@dataclass
class CompileResult:
    """One case on one rank: what differed or failed, the regions, graph breaks, compile seconds (this
    rank's, the wait for other ranks excluded) and the largest distance / noise-floor ratio seen."""
    label: str
    failures: list = field(default_factory=list)
    regions: int = 0
    graph_breaks: int = 0
    compile_s: float = 0.0
    worst_ratio: float = 0.0


def _model(name: str):
    torch.manual_seed(0)
    if name == "mixtral":
        from autoshard.testing.hf_zoo import build as zoo
        return zoo("mixtral")
    from autoshard.testing.levers import build
    model, batch, loss_fn, _ = build(name)
    inputs, target = batch(8, 0)
    return model, inputs, target, loss_fn


def _plan_job(name: str, seed, mesh):
    """The job planning one case: what ``autoshard.compile`` plans on rank 0 for these options (the same
    ``driver.choose``; ``for_runtime`` only changes pipelines), as the plan's JSON."""
    def solve() -> dict:
        import autoshard
        model, inputs, target, loss_fn = _model(name)
        return autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                              hardware="cpu", random_seed=seed, checkpoint="full", reshard_after_forward=True,
                              time_limit_s=10).to_json()
    return solve


def compile_worker(rank: int, world: int, cases=CASES, mesh=(2, 2), steps: int = 2) -> list:
    """Every case on this rank (see the module docstring); a list of ``CompileResult``."""
    import autoshard
    from autoshard.plans import Plan
    from autoshard.runtime.compiled_regions import CompiledRegion

    torch.set_num_threads(1)
    cases = [(tuple(case) + ("inductor",))[:3] for case in cases]
    planned = spread_over_ranks([_plan_job(name, seed, mesh) for name, seed, _ in cases])
    out = []
    for (name, seed, backend), outcome in zip(cases, planned):
        label = f"{name} {'solver' if seed is None else f'random plan {seed}'} {backend}"
        model, inputs, target, loss_fn = _model(name)
        ref = copy.deepcopy(model)
        cm = autoshard.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               plan=Plan.from_json(outcome.value()), compile=autoshard.CompileOptions(backend=backend))
        ratios: list = []
        tol = NoiseFloor(TOL.factor, ratios, TOL.fallback)
        result = CompileResult(label)
        result.failures = train_against_one_device(label, cm, ref, (inputs, target), loss_fn=loss_fn, steps=steps,
                                                   tol=tol, optimizer=sgd, gradients=compiled_gradient_mismatches)
        regions = [m for m in cm.program.modules() if isinstance(m, CompiledRegion)]
        uncompiled = [r for r in regions if not r.stats.compiles]
        if not regions or uncompiled:
            result.failures.append(f"{label}: {len(uncompiled)} of {len(regions)} regions never compiled")
        report = cm.compile_report
        result.regions, result.graph_breaks = len(regions), sum(report.graph_breaks.values())
        if name in NO_BREAKS and result.graph_breaks:
            result.failures.append(f"{label}: {result.graph_breaks} graph breaks: {dict(report.graph_breaks)}")
        result.compile_s = report.stats.seconds
        result.worst_ratio = max((r for _, r in ratios), default=0.0)
        out.append(result)
    return out
