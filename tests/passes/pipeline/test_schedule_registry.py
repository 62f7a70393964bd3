"""The schedule registry: every descriptor is consistent with its generator, a schedule added to the
registry alone is usable everywhere, and ``pp="auto"`` picks interleaved 1F1B with v > 2 stages per
rank and a microbatch count that is not a multiple of pp where that is fastest. One process, meta models.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.errors import AutoshardError
from autoshard.passes.pipeline.schedule.actions import COMPUTE_KINDS
from autoshard.passes.pipeline.schedule.generators import generate, stage_rank
from autoshard.passes.pipeline.schedule.orders import one_f_one_b_order
from autoshard.passes.pipeline.schedule.registry import SCHEDULES, Schedule, get_schedule, searched_schedules
from autoshard.passes.pipeline.schedule.simulate import ScheduleError, StageCosts, simulate
from autoshard.passes.pipeline.stages.planner import plan_pipeline
from autoshard.passes.pipeline.stages.scoring import DEFAULT_SCHEDULES, held_microbatches
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.plan import Plan, Stage
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext


def test_every_descriptor_matches_its_generator():
    for name, desc in SCHEDULES.items():
        assert get_schedule(name) is desc and desc.name == name
        for p in (2, 3, 4):
            owner = desc.stage_rank(p)
            assert len(owner) == p * desc.virtual_stages
            assert all(owner.count(r) == desc.virtual_stages for r in range(p))
            for m in (1, p + 1, 2 * p, 3 * p + 1):
                if not desc.accepts(p, m):
                    assert isinstance(desc.problem(p, m), str)
                    with pytest.raises(ScheduleError, match=name):
                        generate(name, p, m)
                    continue
                sched = generate(name, p, m)
                kinds = {a.kind for acts in sched.values() for a in acts if a.kind in COMPUTE_KINDS}
                assert ("B" in kinds) == desc.split_backward, (name, p, m)
                assert len(desc.approx_held(p, m)) == len(owner)
                assert len(held_microbatches(name, p, m)) == len(owner)
                # counted on the compute order alone, as the simulator counts the whole schedule
                assert list(held_microbatches(name, p, m)) == simulate(sched).peak_stage, (name, p, m)


def test_interleaved_family_takes_any_v():
    assert get_schedule("interleaved-1f1b-v2") is get_schedule("interleaved-1f1b")
    v7 = get_schedule("interleaved-1f1b-v7")
    assert (v7.name, v7.virtual_stages, v7.v_shape) == ("interleaved-1f1b-v7", 7, False)
    assert stage_rank("interleaved-1f1b-v7", 3) == [s % 3 for s in range(21)]
    for m in (3, 5, 7):  # 5 and 7 are not multiples of p = 3
        r = simulate(generate("interleaved-1f1b-v7", 3, m), StageCosts(f=1 / 7, b=1 / 7, w=1 / 7))
        assert r.bubble_fraction == pytest.approx(2 / (7 * m + 2))
    for bad in ("interleaved-1f1b-v1", "interleaved-1f1b-v0", "interleaved-1f1b-vx", "interleaved"):
        with pytest.raises(ScheduleError, match="unknown schedule"):
            get_schedule(bad)
    assert {"interleaved-1f1b", "interleaved-1f1b-v3", "interleaved-1f1b-v4"} <= set(DEFAULT_SCHEDULES)
    assert DEFAULT_SCHEDULES == searched_schedules()


def _stages(pp: int, virtual: int) -> list:
    return [Stage(s, [], s % pp, [s % pp], Mesh((1,))) for s in range(pp * virtual)]


def test_pipeline_plan_checks_the_schedule_and_its_stages_per_rank():
    with pytest.raises(ValueError, match="unknown schedule 'zb-h9'"):
        Plan(_stages(2, 1), Mesh((2,)), "zb-h9", 4)
    with pytest.raises(ValueError, match="runs 3 stage\\(s\\) per rank group, but the plan has 2"):
        Plan(_stages(2, 2), Mesh((2,)), "interleaved-1f1b-v3", 4)
    assert Plan(_stages(2, 3), Mesh((2,)), "interleaved-1f1b-v3", 5).virtual == 3


def _gpt(layers: int, batch: int, seq: int = 128):
    with torch.device("meta"):
        model = GPT(512, 512, layers, 8, seq, False)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


@pytest.fixture(scope="module")
def twelve_blocks():
    return _gpt(12, 6)


@pytest.fixture(scope="module")
def twelve_longer_blocks():
    """Sequences of 256: at 128 tokens a microbatch's fp32 GEMMs take a few microseconds on the h100
    preset, and the per-stage costs of more virtual stages outweigh the bubbles they save."""
    return _gpt(12, 6, seq=256)


def test_a_schedule_added_to_the_registry_alone_is_usable(monkeypatch, twelve_blocks):
    """One descriptor (here 1F1B's order under a new name) and nothing else: the generator, the
    plan's check and the stage planner's pins accept it."""
    monkeypatch.setitem(SCHEDULES, "my-1f1b", Schedule("my-1f1b", 1, v_shape=False, split_backward=False,
                                                       order=one_f_one_b_order))
    assert [str(a) for a in generate("my-1f1b", 2, 2)[0]] == [str(a) for a in generate("1f1b", 2, 2)[0]]
    plan = plan_pipeline(twelve_blocks, (4,), PlanContext.of(_tight(), time_limit_s=10),
                         PipelinePins(pp=2, schedule="my-1f1b", microbatches=3))
    assert (plan.pp, plan.virtual, plan.schedule, plan.microbatches) == (2, 1, "my-1f1b", 3)
    with pytest.raises(AutoshardError, match="unknown schedule 'nope'"):
        plan_pipeline(twelve_blocks, (4,), PlanContext.of(_tight(), time_limit_s=60.0), PipelinePins(schedule="nope"))


def _tight():
    return dataclasses.replace(PRESETS["h100"], memory_bytes=2.5e8)  # too small for one stage: pipelining pays


def test_auto_pp_picks_interleaved_with_more_virtual_stages_and_odd_microbatches(twelve_longer_blocks):
    """Among the interleaved family (and 1F1B), ``pp=None`` on 4 devices picks pp = 4 with 3 stages
    per rank and 6 microbatches (6 % 4 = 2): fewer bubbles than v = 2, and faster than what the
    search finds when v is held to 2."""
    family = ("1f1b", "interleaved-1f1b", "interleaved-1f1b-v3", "interleaved-1f1b-v4")
    plan = plan_pipeline(twelve_longer_blocks, (4,), PlanContext.of(_tight(), time_limit_s=10),
                         PipelinePins(schedule=family))
    assert (plan.pp, plan.virtual, plan.schedule, plan.microbatches) == (4, 3, "interleaved-1f1b-v3", 6)
    assert len(plan.stages) == 12 and [s.group for s in plan.stages] == [s % 4 for s in range(12)]
    two = plan_pipeline(twelve_longer_blocks, (4,), PlanContext.of(_tight(), time_limit_s=10),
                        PipelinePins(schedule=family[:2]))
    assert plan.estimated_step_time < two.estimated_step_time
