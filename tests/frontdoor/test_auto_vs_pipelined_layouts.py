"""``plan(pp="auto")`` is never slower than a published pipeline layout of its cluster under the same memory
limit (issue 27 done-means 2, issue 28 item 4).

The case, Meta's Llama 3 405B layout in small: a meta GPT of 14 blocks with a large vocabulary (the
embedding and the head outweigh a block) on 2 H100s, laid out as Megatron-Core runs it: pp 2 x 8 virtual
stages (interleaved 1F1B), the embedding and the head each a stage of its own
(``account_for_embedding/loss_in_pipeline_split``: 14 blocks + 2 = 16 stages), no recompute. ``pp="auto"``
then plans under the memory the layout's own plan needs, and must be at least as fast.

On main before this test passed, ``pp="auto"`` found no plan there (InfeasiblePlanError): the even cut that
equals the layout fits only when a group of several stages is priced at the schedule's worst moment, and the
stage search's even pass checked it as the sum of its stages' own peaks. The even pass now checks it by the
moments, compile's per-stage re-solve (``stages/retrace.py``) budgets each stage by its group's peak at the
worst moment too (``tests/passes/pipeline/test_retrace_group_budget.py``), and a group's moments count every
stage's accumulated gradients and the sends the runtime keeps (``stage_problem.stage_memory_record``, as the
runtime's ``stage_peak.stage_memory_record``).
"""
from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.passes.pipeline.group_peak import group_peaks
from autoshard.passes.pipeline.schedule.registry import SEARCHED_VIRTUAL_STAGES, get_schedule
from autoshard.passes.pipeline.stages.search_spec import DEFAULT_SCHEDULES
from autoshard.testing.models import GPT, lm_loss


def test_interleaving_is_searched_up_to_the_published_eight_virtual_stages():
    assert SEARCHED_VIRTUAL_STAGES >= 8
    searched = {get_schedule(s).virtual_stages for s in DEFAULT_SCHEDULES if get_schedule(s).family}
    assert searched == set(range(2, SEARCHED_VIRTUAL_STAGES + 1))


@pytest.fixture(scope="module")
def case():
    with torch.device("meta"):
        model = GPT(vocab=32000, d=256, n_layer=14, n_head=8, seq=128, tied=False)
    ids = torch.empty(16, 128, dtype=torch.long, device="meta")
    return model, dict(example_inputs=(ids,), loss_fn=lm_loss, example_target=ids, hardware="h100")


def test_auto_is_not_slower_than_a_v8_layout_with_the_embedding_and_head_alone_at_its_memory(case):
    model, common = case
    meta = layouts.megatron(pp=2, virtual_stages=8, distributed_optimizer=True, recompute="none",
                            account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    layout = autoshard.plan(model, 2, layout=meta, memory_limit=1e15, **common)
    assert (layout.pp, layout.virtual, len(layout.stages)) == (2, 8, 16)
    first, last = layout.stages[0].nodes, layout.stages[-1].nodes
    assert "embedding" in first and not any(n.startswith("linear") for n in first)  # the embedding alone
    assert last[-1] == "cross_entropy_loss" and sum(n.startswith("linear") for n in last) == 1  # the head alone
    peaks = group_peaks(((s.index, s.group, s.solution.estimated, s.solution.estimated_memory) for s in layout.stages),
                        layout.schedule, layout.pp, layout.microbatches)
    assert layout.estimated_memory >= max(peaks.values())  # as a memory limit, the plan's memory admits the plan
    ours = autoshard.plan(model, 2, pp="auto", memory_limit=layout.estimated_memory, **common)
    assert ours.estimated_memory <= layout.estimated_memory
    assert ours.estimated_step_time <= layout.estimated_step_time * (1 + 1e-9), \
        (ours.pp, ours.virtual, ours.microbatches, ours.estimated_step_time, layout.estimated_step_time)
