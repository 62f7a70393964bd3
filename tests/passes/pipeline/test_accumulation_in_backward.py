"""Gradient accumulation is priced where it runs: inside each backward after the first microbatch's
(autograd's AccumulateGrad; Megatron-LM's main_grad hook), so it lengthens a pipeline's warm-up and
drain, not only the step's tail after the gradient sync (``scoring.accumulation_share``)."""
from __future__ import annotations

import pytest

from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.layer_costs import SubmeshProfile, UnitCost
from autoshard.passes.pipeline.stages.scoring import held_microbatches, score_stages, single_stage_step, stage_problem
from autoshard.passes.solve.context import PlanContext


def _profile(units: int, accumulate: float) -> SubmeshProfile:
    costs = [UnitCost(fwd_batch=1.0, bwd_batch=2.0, accumulate=accumulate, opt_step=0.25) for _ in range(units)]
    return SubmeshProfile(Mesh((1,)), [], costs, cut_fixed=[0.0] * (units - 1), cut_batch=[0.0] * (units - 1),
                          overlap_grad_sync=False)


@pytest.mark.parametrize("p, m", [(4, 8), (2, 3)])
def test_accumulations_lengthen_every_backward_and_so_the_bubble(p, m):
    acc = 0.5
    ctx = PlanContext.of("a100")
    prob = stage_problem(_profile(p, acc), (p, m, "1f1b"), Mesh((p, 1)), ctx, held_microbatches("1f1b", p, m))
    step, _ = score_stages(prob, "1f1b", list(range(p)), [False] * p)
    f, b = 1.0 / m, 2.0 / m  # one unit per stage; a microbatch is 1/m of the batch
    # uniform 1F1B: (m + p - 1) slots of F + B, each backward carrying (m - 1) / m of one accumulation;
    # then the optimizer step. Priced after the sync instead, the bubble's p - 1 slots would miss it:
    # (m + p - 1)(f + b) + (m - 1) acc + step, shorter by (p - 1)(m - 1) / m x acc
    want = (m + p - 1) * (f + b + (m - 1) / m * acc) + 0.25
    assert step == pytest.approx(want, rel=1e-12)
    assert step - ((m + p - 1) * (f + b) + (m - 1) * acc + 0.25) == pytest.approx((p - 1) * (m - 1) / m * acc)


def test_one_microbatch_accumulates_nothing():
    prof = _profile(3, accumulate=10.0)
    assert single_stage_step(prof) == pytest.approx(3 * (1.0 + 2.0) + 3 * 0.25)


def test_blocking_sends_cost_the_sender_too():
    """DeepSpeed's pipeline engine sends with a blocking ``dist.send``: a stage's stream carries its sends
    as well as its receives, two more transfers per microbatch for a middle stage."""
    p, m = 4, 8
    prof = _profile(p, accumulate=0.0)
    prof.cut_fixed = [4e9] * (p - 1)  # 4 GB per boundary: seconds on any link
    ctx = PlanContext.of("a100")
    held = held_microbatches("1f1b", p, m)
    posted = stage_problem(prof, (p, m, "1f1b"), Mesh((p, 1)), ctx, held)
    prof.blocking_sends = True
    blocking = stage_problem(prof, (p, m, "1f1b"), Mesh((p, 1)), ctx, held)
    assert posted.send_seconds is None and blocking.send_seconds == pytest.approx(posted.cut_seconds)
    send = blocking.send_seconds[0]
    assert send > 0.01
    starts, rec = list(range(p)), [False] * p
    before, _ = score_stages(posted, "1f1b", starts, rec)
    after, _ = score_stages(blocking, "1f1b", starts, rec)
    # a middle stage's m forwards and m backwards each carry one more transfer; the warm-up and drain
    # at most p - 1 more slots of them
    assert 2 * m * send * (1 - 1e-9) <= after - before <= 2 * (m + p - 1) * send * (1 + 1e-9)
