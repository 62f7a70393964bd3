"""A pipeline stage's per-microbatch price does not depend on how many microbatches the batch is cut into
(issue 27: the MT-NLG 530B head cost 6.46 / 12.30 ms per microbatch at dp 8 and 5.41 / 10.18 at dp 12,
the same work per rank).

Megatron's layout (tp 8, pp 2, microbatch 1) on a GPT with MT-NLG's vocabulary (50,272: 6,284 head
columns per tp rank, not a whole number of GEMM tiles) on the meta device, planned through
``autoshard.plan`` on a data axis of 8 and of 12 with the same global batch: 12 and 8 microbatches of one
sequence per rank. ``layer_costs.profile_submesh`` priced a GEMM's efficiency on the whole batch's shape
and charged that excess once per microbatch, so the head cost more the more microbatches there were.
The head's per-microbatch forward + backward is read from the stage planner's profile of each plan."""
from __future__ import annotations

import torch

import autoshard
from autoshard import layouts
from autoshard.passes.pipeline.stages import search
from autoshard.testing.models import GPT, lm_loss

SEQ, VOCAB, BATCH = 2048, 50272, 96


def head_per_microbatch(dp: int, monkeypatch) -> tuple[float, int]:
    """(forward + backward seconds of the head unit per microbatch, microbatches) of the layout's plan."""
    seen = []
    profile = search.profile_submesh

    def keep(captured, solution, ctx=None, *, units=None):
        prof = profile(captured, solution, ctx, units=units)
        seen.append((prof, solution.solver_stats["microbatches"]))
        return prof

    monkeypatch.setattr(search, "profile_submesh", keep)
    with torch.device("meta"):
        model = GPT(VOCAB, 4096, 2, 32, SEQ, tied=True)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    layout = layouts.megatron(tp=8, pp=2, microbatch_size=1, recompute="full", sequence_parallel=False)
    plan = autoshard.plan(model, (dp * 2, 8), example_inputs=(ids,), loss_fn=lm_loss, example_target=ids,
                          layout=layout, hardware="a100", memory_limit=1e15)
    assert plan.pp == 2 and plan.microbatches == BATCH // dp and seen
    prof, m = seen[-1]
    assert m == plan.microbatches
    head = prof.costs[-1]
    return head.fwd(m) + head.bwd(m), m


def test_head_price_per_microbatch_does_not_depend_on_the_microbatch_count(monkeypatch):
    at_8, m_8 = head_per_microbatch(8, monkeypatch)
    at_12, m_12 = head_per_microbatch(12, monkeypatch)
    assert (m_8, m_12) == (12, 8)
    # the same work per rank; only the loss's scalar all-reduce over dp (latency) may differ
    assert abs(at_8 / at_12 - 1) < 0.01, (at_8, at_12)
