"""Activation recomputation in the pipeline runtime.

A stage that recomputes runs F without autograd (it keeps only its inputs and RNG state) and runs the
forward again before its B or BW. On 2 gloo ranks (pp=2), a model with BatchNorm and Dropout:

- without dropout, both stages recomputing match one device (loss every step, full parameters and
  BatchNorm running statistics after 3 AdamW steps): the re-run must not update running stats twice;
- with dropout, recomputing and keeping activations give the same losses and parameters (the re-run
  draws the same random masks), under 1F1B (BW) and ZB-H1 (B then W);
- after F, a recomputing stage holds no autograd graph for the microbatch.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autoshard.testing.equivalence import Tolerance, adamw, failures_of, tensor_mismatches, train_against_one_device
from autoshard.testing.ranks import run_ranks
from autoshard.passes.solve.context import PlanContext

STEPS = 3
TOL = Tolerance(rtol=1e-4, atol=2e-5)


class Net(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(p))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 4))

    def forward(self, x):
        return self.b(self.a(x))


def _program(model, x, y, schedule: str, recompute: bool, m: int):
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.schedule.generators import generate
    from autoshard.passes.pipeline.plan import Plan
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.executor import RankProgram
    from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
    from autoshard.passes.pipeline.stages.stage_graphs import stage_nodes_from_prefixes

    mb = len(y) // m
    captured = capture(model, (x[:mb],), loss_fn=nn.functional.cross_entropy, target=y[:mb])
    payload = None
    if torch.distributed.get_rank() == 0:
        nodes = stage_nodes_from_prefixes(captured, ["b"])
        plan = make_pipeline_plan(captured, nodes, (2,), schedule=schedule, microbatches=m,
                                  solve=lambda g, sm: plan_sharding(g.captured, sm,
                                                                    PlanContext.of("cpu", time_limit_s=10)))
        for s in plan.stages:
            s.recompute = recompute
        payload = plan.to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0))
    return RankProgram(plan.attach(captured), schedule=generate(schedule, 2, m), model=model)


def _microbatched_loss(reference, inputs, y):
    """The reference sees the pipeline's 4 microbatches, so BatchNorm's batch statistics agree."""
    (x,) = inputs
    return sum(nn.functional.cross_entropy(reference(xm), ym) for xm, ym in zip(x.chunk(4), y.chunk(4))) / 4


def _train(prog, x, y) -> tuple[list, dict]:
    opt = torch.optim.AdamW(prog.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for _ in range(STEPS):
        losses.append(prog.step(x, target=y))
        opt.step()
        opt.zero_grad()
    return losses, prog.full_state_dict()


def recompute_worker(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    failures = []
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)

    # deterministic model: recomputation against one device (running statistics included)
    torch.manual_seed(0)
    model = Net(0.0)
    prog = _program(model, x, y, "1f1b", True, 4)
    failures += train_against_one_device("recompute vs one device", prog, copy.deepcopy(model), (x, y),
                                         reference_loss=_microbatched_loss, steps=STEPS, tol=TOL,
                                         optimizer=adamw(lr=1e-3, eps=1e-6))

    # a recomputing stage keeps no graph between F and B
    stage = next(iter(prog.stages.values()))
    leaves = [t.detach().requires_grad_(True) for t in ([] if stage.index == 0 else [torch.randn(4, 32)])]
    outs = stage.forward(99, [x[:4]] if stage.index == 0 else [], leaves, y[:4] if stage.graph.reads_target else None)
    if any(o.requires_grad for o in outs):
        failures.append(f"stage {stage.index}: a recomputing forward built an autograd graph")
    stage.saved.pop(99)

    # with dropout: the re-run draws the same masks as the first run
    for schedule in ("1f1b", "zb-h1"):
        runs = []
        for recompute in (False, True):
            torch.manual_seed(0)
            model = Net(0.3)
            prog = _program(model, x, y, schedule, recompute, 4)
            torch.manual_seed(123 + rank)
            runs.append(_train(prog, x, y))
        (l0, s0), (l1, s1) = runs
        if not all(TOL.loss_close(b, a) for a, b in zip(l0, l1)):
            failures.append(f"dropout {schedule}: losses {l1} with recompute, {l0} without")
        failures += tensor_mismatches(f"dropout {schedule} with recompute", s1, s0, TOL)
    return failures


def test_recompute_matches_keeping_activations_and_one_device():
    failures = failures_of(run_ranks(recompute_worker, 2, timeout=300))
    assert not failures, "\n".join(failures)
