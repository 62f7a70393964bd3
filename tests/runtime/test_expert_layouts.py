"""Expert-parallel layouts (issue 28 item 3): ``layouts.megatron(ep=, etp=)`` and ``layouts.fsdp(ep=)`` are
planned by ``autoshard.plan(layout=...)``, saved, compiled with ``autoshard.compile(plan=...)`` on 4 gloo
ranks and trained against one device running the model's own code (loss every step, first-step
gradients, the full state after 2 AdamW steps), for small Hugging Face MoE models:

- Mixtral, ``megatron(ep=4)``: every expert on its own rank, tokens dispatched by all-to-all;
- Mixtral, ``megatron(tp=2, ep=2, etp=1)``: parallel folding, the experts split over the ranks the
  attention uses for tensor parallelism;
- Mixtral, ``megatron(tp=2, ep=2, distributed_optimizer=True)``: experts split over dp and inside
  each expert over tp (etp = tp, Megatron's default), weights sharded over dp;
- Qwen2-MoE (a shared expert next to the routed ones), ``fsdp(ep=2)``: torchtitan's EP x FSDP;
- Mixtral, ``megatron(pp=2, ep=2)``: a pipeline whose stages dispatch over their own two ranks;
- the GPT toy, ``megatron(cp=2, pp=2)``: context parallelism inside pipeline stages (ring attention on
  each stage's two ranks), which layouts used to refuse.

Each MoE program has one pair of uneven all-to-alls (dispatch, combine) per MoE layer it holds, as
priced. All cases run in one spawn of 4 ranks.
"""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import autoshard  # noqa: E402
from autoshard import layouts  # noqa: E402
from autoshard.testing.equivalence import (Tolerance, adamw, compiled_gradient_mismatches,  # noqa: E402
                                           failures_of, train_against_one_device)
from autoshard.testing.hf_zoo import ZOO  # noqa: E402
from autoshard.testing.models import gpt  # noqa: E402
from autoshard.testing.ranks import run_ranks  # noqa: E402

CASES = [
    ("mixtral", layouts.megatron(ep=4, recompute="none")),
    ("mixtral", layouts.megatron(tp=2, ep=2, etp=1, recompute="none")),
    ("mixtral", layouts.megatron(tp=2, ep=2, recompute="none", distributed_optimizer=True)),
    ("qwen2_moe", layouts.fsdp(ep=2)),
    ("mixtral", layouts.megatron(pp=2, ep=2, recompute="none")),
    ("gpt", layouts.megatron(cp=2, pp=2, recompute="none")),
]
TOL = Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-6)


def build(name: str):
    return gpt(n_layer=4) if name == "gpt" else ZOO[name]()


def _plan(name: str, layout):
    torch.manual_seed(0)
    model, inputs, target, loss_fn = build(name)
    return autoshard.plan(model, 4, example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu",
                          layout=layout, time_limit_s=10)


def layout_worker(rank: int, world: int, paths: list) -> list:
    """Each saved layout plan compiled on this rank and trained next to one device; failures, and the
    dispatch all-to-alls counted in this rank's program."""
    out = []
    for (name, layout), path in zip(CASES, paths):
        saved = autoshard.load_plan(path)
        torch.manual_seed(0)
        model, inputs, target, loss_fn = build(name)
        ref = copy.deepcopy(model)
        cm = autoshard.compile(model, saved.mesh.shape, example_inputs=inputs, loss_fn=loss_fn,
                               example_target=target, plan=saved)
        label = f"{name} {layout.describe()}"
        check = None if layout.pp > 1 else (lambda p, r, label=label: compiled_gradient_mismatches(label, p, r, TOL))
        failures = train_against_one_device(label, cm, ref, (inputs, target), loss_fn=loss_fn, steps=2, tol=TOL,
                                            optimizer=adamw(eps=1e-6), check_gradients=check)
        out.append((failures, _all_to_alls(cm)))
    return out


def _all_to_alls(cm) -> int:
    """Uneven all-to-alls in this rank's program (every stage it runs, for a pipeline)."""
    from autoshard.runtime.lower import COLLECTIVE_META
    if hasattr(cm, "collective_counts"):
        return cm.collective_counts().get("all_to_all_v", 0)
    return sum(1 for stage in cm._program.stages.values() for m in stage.program.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
               if n.meta.get(COLLECTIVE_META) == "all_to_all_v")


def _moe_layers(plan) -> int:
    return sum(1 for n in plan.captured.gm.graph.nodes if str(n.target).startswith("autoshard.moe_experts"))


@pytest.mark.slow
def test_expert_parallel_layouts_train_as_one_device(tmp_path):
    paths, dispatched = [], []
    for i, (name, layout) in enumerate(CASES):
        plan = _plan(name, layout)
        stages = plan.stages if layout.pp > 1 else [plan]
        moe = [st for s in stages for n, st in s.solution.strategies.items() if n.startswith("moe_experts")]
        assert all("expert_dispatch" in st.lowerings for st in moe), (layout.describe(), moe)
        assert bool(moe) == (name != "gpt")
        if layout.cp > 1:  # premise: ring attention over each stage's cp ranks
            rings = [st for s in stages for n, st in s.solution.strategies.items() if n.startswith("scaled_dot")]
            assert rings and all("ring_attention" in st.lowerings for st in rings), rings
        dispatched.append(2 * _moe_layers(plan) // layout.pp)  # one dispatch + one combine per layer a rank holds
        path = tmp_path / f"plan{i}.json"
        plan.save(str(path))
        paths.append(str(path))
    results = run_ranks(layout_worker, 4, paths, timeout=900)
    failures = failures_of([[f for case in per_rank for f in case[0]] for per_rank in results])
    assert not failures, "\n".join(failures)
    for rank, per_rank in enumerate(results):
        for (name, layout), (_, calls), want in zip(CASES, per_rank, dispatched):
            assert calls == want, (rank, layout.describe(), calls, want)
