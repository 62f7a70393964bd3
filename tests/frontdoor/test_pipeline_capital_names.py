"""Parameters whose names hold capital letters (Mamba's ``A_log`` and ``D``, a toy's ``W``) through
pipelines. torch.fx's ``Graph.placeholder(name)`` derives a node's name from its target in snake case
(``p_W`` -> ``p_w``), so a stage graph built that way no longer matches the plan's keys; stage graphs
and per-rank programs now create placeholders under their exact names. ``plan(pp=2)`` on a meta model
plans every such parameter; ``compile(pp=2)`` on 4 gloo ranks trains like one device."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks


class CapitalBlock(nn.Module):
    """A gated residual block with Mamba-style parameter names."""
    def __init__(self, d: int):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.D = nn.Parameter(torch.ones(d))
        self.A_log = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.W) * self.D + x * torch.exp(-torch.exp(self.A_log))


class CapitalNet(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.Embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(CapitalBlock(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _build(device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = CapitalNet()
    x = torch.randn(8, 16, device=device)
    return model, (x,), torch.randn(8, 16, device=device)


def test_plan_pp_2_places_every_capital_letter_parameter():
    import autoshard
    model, inputs, target = _build("meta")
    plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=F.mse_loss, example_target=target,
                          hardware="cpu", pp=2, microbatches=2, time_limit_s=20)
    assert plan.pipelined
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.A_log", "layers.3.D", "layers.2.W", "Embed.weight"} <= names
    assert set(plan.param_placements) == names
    # the stage cut moved onto the microbatch trace and every stage re-solved there, as compile does
    from autoshard.passes.capture.export import capture
    from autoshard.passes.pipeline.stages.retrace import replan_at_microbatch
    from autoshard.passes.solve.context import PlanContext
    full = capture(model, inputs, loss_fn=F.mse_loss, target=target)
    small = capture(model, tuple(x[:4] for x in inputs), loss_fn=F.mse_loss, target=target[:4])
    staged = replan_at_microbatch(plan, full, small, PlanContext.of("cpu", time_limit_s=20))
    placed = {n for s in staged.stages for n in s.solution.param_placements}
    assert placed == names


def capital_worker(rank: int, world: int) -> list:
    import autoshard

    torch.set_num_threads(1)
    model, inputs, target = _build()
    cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=F.mse_loss, example_target=target,
                           hardware="cpu", pp=2, microbatches=2, time_limit_s=20)
    if not cm.plan.pipelined:
        return [f"capital names pp=2: got {type(cm).__name__}"]
    failures = train_against_one_device("capital names pp=2", cm, copy.deepcopy(model), (inputs, target),
                                        loss_fn=F.mse_loss, steps=3, tol=Tolerance(rtol=1e-4, atol=2e-5),
                                        optimizer=adamw(lr=1e-2))
    full = cm.full_state_dict()
    if "layers.1.A_log" not in full:
        failures.append(f"capital names pp=2: full_state_dict lacks layers.1.A_log: {sorted(full)[:6]}")
    return failures


def test_compile_pp_2_with_capital_letter_parameters_equals_one_device():
    failures = failures_of(run_ranks(capital_worker, 4, timeout=300))
    assert not failures, "\n".join(failures)
