"""``layouts.megatron(blocking_p2p=True)`` (DeepSpeed's pipeline engine) is timed with the "1f1b" schedule.
That is right only if DeepSpeed's ``TrainSchedule`` runs each stage's forwards and backwards in 1F1B's
order. DeepSpeed splits a step into 2 (m + p - 1) slots. In each slot a stage runs one forward or one
backward: forwards in the slots of its own parity, backwards in the others, shifted so that a
microbatch's forward reaches stage s s slots after stage 0 and its backward leaves the last stage one
slot after its forward (deepspeed/runtime/pipe/schedule.py, ``TrainSchedule._step_to_micro_batch``).
The mapping below is written from that description. The test checks that it gives the same per-stage
compute order as the planner's "1f1b" for every p and m tried, fewer microbatches than stages included."""
from __future__ import annotations

import pytest

from autoshard.passes.pipeline.schedule.generators import generate


def deepspeed_train_order(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s ("F" | "B", microbatch) sequence under DeepSpeed's TrainSchedule."""
    out = []
    for slot in range(2 * (m + p - 1)):
        forward = slot % 2 == stage % 2
        half = slot // 2
        if forward:
            mb = half - stage // 2
        elif stage % 2:   # odd stage, backward on an even slot
            mb = half - p + (stage + 1) // 2
        else:             # even stage, backward on an odd slot
            mb = (slot - 1) // 2 - p + 1 + stage // 2
        if 0 <= mb < m:
            out.append(("F" if forward else "B", mb))
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 35])
def test_deepspeed_train_schedule_runs_1f1b_compute_order(p):
    for m in sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p + 1, 40}):
        planned = generate("1f1b", p, m)
        for s in range(p):
            ours = [("F" if a.kind == "F" else "B", a.microbatch) for a in planned[s] if a.kind in ("F", "BW")]
            theirs = deepspeed_train_order(s, p, m)
            assert len(theirs) == 2 * m, (p, m, s)
            assert ours == theirs, f"p={p} m={m} stage {s}: 1f1b {ours[:8]} vs DeepSpeed {theirs[:8]}"
