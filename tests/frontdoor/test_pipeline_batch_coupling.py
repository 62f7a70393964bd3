"""A pipeline runs BatchNorm per microbatch: ``plan(..., pp=)`` warns, naming the ops, and the
pipelined plan's summary says so, also after a JSON round trip (issue 17, item 1)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.plans import Plan
from autoshard.testing.models import BlockCNN


def test_pipelined_batch_norm_warns_and_the_summary_says_per_microbatch():
    torch.manual_seed(0)
    model = BlockCNN()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    with pytest.warns(autoshard.BatchCouplingWarning, match=r"4 microbatches.*module 'blocks\.0\.bn'"):
        plan = autoshard.plan(model, (2,), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y,
                              hardware="cpu", pp=2, microbatches=4)
    assert plan.pipelined
    loaded = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    for p in (plan, loaded):
        line = next(ln for ln in p.summary().splitlines() if "batch-coupled" in ln)
        assert "per microbatch of 1/4" in line and "blocks.1.bn" in line
