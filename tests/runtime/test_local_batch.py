"""``cm.step(..., local_batch=True)``: each rank passes only its data-parallel slice; the step is the same.

On 4 gloo ranks, for data parallel on (4,) and (2, 2), Megatron tensor parallel on (2, 2) (data
parallel on axis 0 only) and a 2-stage pipeline whose stages are data parallel on their 2-rank
submeshes: one compiled model trains on the full batch,
a second one (same plan) on local slices cut by ``data_parallel_rank`` / ``data_parallel_size``; losses
and parameters after two AdamW steps match (exactly on the plain path, where the same local rows meet
the same ops). Ranks along a non-data-parallel axis passing different slices, or a slice of the wrong
shape, get a ``BatchError`` on every rank.
"""
from __future__ import annotations

import torch

from autoshard.testing.ranks import run_ranks
from autoshard.passes.solve.context import PlanContext

STEPS = 2


def _slice(t: torch.Tensor, cm) -> torch.Tensor:
    n = t.shape[0] // cm.data_parallel_size
    return t[cm.data_parallel_rank * n:(cm.data_parallel_rank + 1) * n]


def data_parallel_pipeline(model, inputs, target, loss_fn, prefixes, microbatches: int = 2):
    """A 2-stage pipeline over 4 ranks, each stage data parallel on its 2-rank submesh (every stage's
    inputs pinned ``S(0)``, parameters ``R``), built by hand from the captured microbatch program."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.sharding.pins import Pins
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.executor import RankProgram
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes
    mb = target.shape[0] // microbatches
    captured = capture(model, tuple(x[:mb] for x in inputs), loss_fn=loss_fn, target=target[:mb])
    payload = None
    if torch.distributed.get_rank() == 0:
        def solve(g, sm):
            names = list(g.captured.inputs) + ([g.captured.target] if g.captured.target else [])
            pins = Pins(params={"*": ("R",)}, inputs={n: ("S(0)",) for n in names})
            return plan_sharding(g.captured, sm, PlanContext.of("cpu", time_limit_s=10), pins=pins)
        payload = make_pipeline_plan(captured, stage_nodes_from_prefixes(captured, prefixes[2]), Mesh.of((2, 2)),
                                     schedule="1f1b", microbatches=microbatches, solve=solve).to_json()
    plan = Plan.from_json(broadcast_json(payload))
    program = RankProgram(plan.attach(captured), schedule=generate("1f1b", 2, microbatches), model=model)
    from autoshard.compiled import CompiledModel
    return CompiledModel(None, program.plan, program=program)


def local_batch_worker(rank: int, world: int) -> list:
    import autoshard
    from autoshard import presets
    from autoshard.testing.models import gpt_pipeline, mlp
    failures = []
    cases = [("dp", "mlp", (4,), presets.data_parallel((4,), batch_inputs=(0, 1)), (4, rank)),
             ("dp 2-D", "mlp", (2, 2), presets.data_parallel((2, 2), batch_inputs=(0, 1)), (4, rank)),
             ("tp", "mlp", (2, 2), "megatron", (2, rank // 2)),
             ("pipeline", "gpt", (2, 2), "pipeline", (2, rank % 2))]
    for label, model_name, mesh, kw, expected in cases:
        torch.manual_seed(0)
        model, inputs, target, loss_fn, *prefixes = mlp() if model_name == "mlp" else gpt_pipeline(n_layer=2)
        if kw == "megatron":
            kw = presets.megatron_mlp(model, ["fc1"], ["fc2"], mesh, batch_inputs=(0, 1))
        common = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
        if kw == "pipeline":
            full, local = (data_parallel_pipeline(model, inputs, target, loss_fn, prefixes[0]) for _ in range(2))
        else:
            full = autoshard.compile(model, mesh, **common, **kw)
            local = autoshard.compile(model, mesh, **common, plan=full.plan)
        got = (local.data_parallel_size, local.data_parallel_rank)
        if got != expected:
            failures.append(f"{label}: data parallel (size, rank) {got}, expected {expected}")
        opt_full = torch.optim.AdamW(full.parameters(), lr=1e-2)
        opt_local = torch.optim.AdamW(local.parameters(), lr=1e-2)
        exact = label != "pipeline"
        for step in range(STEPS):
            want = full.step(*inputs, target=target)
            have = local.step(*(_slice(x, local) for x in inputs), target=_slice(target, local), local_batch=True)
            if (have != want) if exact else abs(have - want) > 1e-5 * abs(want):
                failures.append(f"{label}: local-batch loss {have!r} at step {step}, full batch {want!r}")
            for opt in (opt_full, opt_local):
                opt.step(); opt.zero_grad()
        a, b = full.full_state_dict(), local.full_state_dict()
        for key in a:
            same = torch.equal(a[key], b[key]) if exact else torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6)
            if not same:
                failures.append(f"{label}: {key} differs after {STEPS} local-batch steps")
        if label == "tp":  # ranks 0 and 1 share data-parallel rank 0: give rank 1 another slice
            wrong = [x.roll(1, 0) if rank % 2 else x for x in inputs]
            try:
                local.step(*(_slice(x, local) for x in wrong), target=_slice(target, local), local_batch=True)
                failures.append(f"{label}: different slices along the tensor-parallel axis were accepted")
            except autoshard.BatchError as e:
                if "differ" not in str(e):
                    failures.append(f"{label}: unexpected message {e}")
            try:
                local.step(*inputs, target=target, local_batch=True)
                failures.append(f"{label}: a full batch was accepted as a local slice")
            except autoshard.BatchError as e:
                if "local_batch=True" not in str(e):
                    failures.append(f"{label}: unexpected message {e}")
    return failures


def test_local_batch_steps_equal_full_batch_steps():
    failures = run_ranks(local_batch_worker, 4, timeout=400)
    assert failures == [[]] * 4, failures
