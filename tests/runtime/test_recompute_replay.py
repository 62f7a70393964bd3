"""Recomputation replays dropout: a checkpointed block re-run draws the same masks as its forward.

Dropout cannot match one device (each rank draws masks for its own slice of the batch), so the
oracle is the same run without checkpointing on the same ranks: the CNN with dropout 0.3 in its
blocks, ZeRO-3 storage of data parallel on (4,), 3 AdamW steps, the same seed on every run. The
runs with selective and with full checkpointing give the same losses and parameters; a run with
another seed does not (the dropout draws something).
"""
from __future__ import annotations

import pytest
import torch

from autoshard.testing.levers import MICRO, build, planned
from autoshard.testing.ranks import run_ranks

STEPS = 3
ADAM_EPS = 1e-6


def dropout_worker(rank: int, world: int) -> dict:
    from autoshard.passes.capture.export import capture
    from autoshard.passes.levers import BlockPolicy, Levers
    from autoshard.passes.mesh import Mesh
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("cnn", dropout=0.3)
    inputs, target = batch(MICRO, 0)
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    env = setup_distributed(Mesh.of((4,)))
    strategies = planned(captured, model, (4,), None, rank, env)
    out = {}
    for policy, seed in (("none", 7), ("selective", 7), ("full", 7), ("none", 8)):
        rp = RankProgram.of_strategies(captured, strategies, (4,), env=env, model=model,
                         levers=Levers(1, {"blocks.#": BlockPolicy(policy)}))
        opt = torch.optim.AdamW(rp.parameters(), lr=1e-3, eps=ADAM_EPS)
        torch.manual_seed(seed + rank)
        losses = []
        for step in range(STEPS):
            x, y = batch(MICRO, 100 + step)
            losses.append(rp.step(*x, target=y))
            opt.step()
            opt.zero_grad()
        out[(policy, seed)] = (losses, rp.full_state_dict())
    return out


def test_recomputation_replays_dropout_masks():
    for rank, runs in enumerate(run_ranks(dropout_worker, 4, timeout=600)):
        base_losses, base_state = runs[("none", 7)]
        other_losses, _ = runs[("none", 8)]
        assert max(abs(a - b) for a, b in zip(base_losses, other_losses)) > 1e-3, "dropout draws nothing"
        for policy in ("selective", "full"):
            losses, state = runs[(policy, 7)]
            assert losses == pytest.approx(base_losses, rel=1e-6, abs=1e-7), (rank, policy)
            for key, value in base_state.items():
                assert torch.allclose(state[key].float(), value.float(), rtol=1e-5, atol=1e-7), (rank, policy, key)
