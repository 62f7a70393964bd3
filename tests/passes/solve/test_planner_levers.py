"""Memory levers in the planner (one process, meta models): checkpointing, reshard-after-forward and
gradient accumulation chosen under memory pressure and not otherwise, pins, exact pricing, random
plans, mixed precision."""
import re

import pytest
import torch

from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.errors import AutoshardError, InfeasiblePlanError
from autoshard.passes.levers import BlockPolicy, Levers, MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve import lever_search, planner
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.solve.random_plans import random_solution
from autoshard.passes.solve.solution import evaluate
from autoshard.passes.spec import Strategy

from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.solve.context import PlanContext

MESH = Mesh.of((4,))


@pytest.fixture(scope="module")
def gpt():
    """A GPT whose activations dwarf its state: 4 blocks of width 128, 8 sequences of 512."""
    with torch.device("meta"):
        model = GPT(256, 128, 4, 4, 512, False)
    ids = torch.empty(8, 512, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids)


@pytest.fixture(scope="module")
def free(gpt):
    return plan_sharding(gpt, MESH, PlanContext.of("h100"), levers=LeverPins())


def _plan(gpt, limit, **pins):
    return plan_sharding(gpt, MESH, PlanContext.of("h100", memory_limit=limit), levers=LeverPins(**pins))


def test_ample_memory_pulls_no_lever(free):
    assert free.levers == Levers() and not free.levers.any_pulled
    assert free.memory_breakdown["recompute"] == 0 and free.time_breakdown["recompute"] == 0
    # what the planner ruled out, it ruled out by bound or by solving: every microstep count was looked at
    assert set(free.solver_stats["accumulation_tried"]) == {"1", "2", "4", "8"}


def test_tight_memory_makes_the_planner_checkpoint_or_accumulate_and_the_plan_fits(gpt, free):
    # under half the fastest plan's memory: below every lever-less layout (the first check), above what
    # checkpointing alone or accumulation alone needs (a quarter was too tight for checkpointing alone
    # once the fastest plan stopped keeping a costly layout's activations: 53 MB, was 136 MB)
    limit = 0.45 * free.estimated_memory
    with pytest.raises(InfeasiblePlanError):  # without levers nothing fits: sharding state is not enough
        plan_sharding(gpt, MESH, PlanContext.of("h100", memory_limit=limit))
    chosen = _plan(gpt, limit)
    assert chosen.levers.any_pulled and chosen.estimated_memory <= limit
    assert chosen.estimated_step_time > free.estimated_step_time
    # with accumulation pinned off, the planner checkpoints the blocks; with checkpointing pinned
    # off, it accumulates
    ckpt = _plan(gpt, limit, accumulation=1)
    assert ckpt.levers.accumulation == 1 and ckpt.levers.blocks["blocks.#"].checkpoint in ("selective", "full")
    assert ckpt.estimated_memory <= limit and ckpt.memory_breakdown["recompute"] > 0
    assert ckpt.time_breakdown["recompute"] > 0
    acc = _plan(gpt, limit, checkpoint="none")
    assert acc.levers.accumulation > 1 and acc.estimated_memory <= limit
    assert chosen.estimated_step_time <= min(ckpt.estimated_step_time, acc.estimated_step_time) * (1 + 1e-9)


def test_the_solver_objective_is_the_evaluated_step_with_levers(gpt, free):
    for pins in ({}, {"accumulation": 1}, {"checkpoint": "selective"}, {"checkpoint": "none"}):
        held = _plan(gpt, 0.45 * free.estimated_memory, **pins)
        # FSDP copies whose gradients reduce once per step are chosen after the ILP
        # (``held_reductions``); the ILP's own answer is the plan without them, and they only gain
        sol = _without_held(gpt, held)
        assert held.estimated_step_time <= sol.estimated_step_time
        assert bool(held.solver_stats.get("held_reductions")) == (held.strategies != sol.strategies)
        sol.solver_stats = held.solver_stats
        # the ILP prices each fused parameter gather on its own (an upper bound); the step prices the
        # runtime's flat calls (``passes.solve.fused_gathers``): the objective is above by exactly that
        saving = sol.estimated["fused_gather_saving_s"]
        assert saving >= 0
        # and the storage forms' per-parameter prices (``passes.cost.storage_prices``) differ from the
        # runtime's buckets and once-per-step reductions the step prices by exactly this
        saving += sol.estimated["storage_form_difference_s"]
        # and the ILP leaves out the flat buffers' copy-in / copy-out (``fused_gathers``), which the step prices
        saving -= sol.estimated["fused_gather_copies_s"]
        assert sol.solver_stats["objective_s"] == pytest.approx(sol.estimated_step_time + saving, rel=1e-9)
        again = evaluate(gpt, MESH, sol.strategies, PlanContext.of("h100", optimizer="adamw"), levers=sol.levers)
        assert again.estimated_step_time == pytest.approx(sol.estimated_step_time, rel=1e-12)
        assert again.estimated_memory == pytest.approx(sol.estimated_memory, rel=1e-12)


def _without_held(gpt, sol):
    strategies = {n: Strategy(st.inputs, st.outputs, tuple(None if f == "once" else f for f in st.lowerings))
                  if n in gpt.params and st.lowerings else st for n, st in sol.strategies.items()}
    if strategies == sol.strategies:
        return sol
    return evaluate(gpt, MESH, strategies, PlanContext.of("h100", optimizer="adamw"), levers=sol.levers)


def test_per_policy_solves_and_the_joint_ilp_find_the_same_optimum(gpt, free, monkeypatch):
    limit = 0.45 * free.estimated_memory
    fixed = _plan(gpt, limit, accumulation=2)
    monkeypatch.setattr(lever_search, "MAX_POLICY_COMBINATIONS", 0)  # one ILP with the one-hot policy rows
    joint = _plan(gpt, limit, accumulation=2)
    # the same ILP optimum, up to the integer scaling of the memory row (the two ILPs scale bytes alike
    # but sum different terms: with ZeRO forms, whose bytes differ in small steps, plans at the memory
    # limit can differ by 2e-4); plans tied there may differ in the step estimate by how their ZeRO
    # parameters fill the runtime's buckets (``storage_buckets``), which the ILP prices per parameter
    assert joint.solver_stats["objective_s"] == pytest.approx(fixed.solver_stats["objective_s"], rel=1e-3)
    assert joint.estimated_step_time == pytest.approx(fixed.estimated_step_time, rel=1e-2)
    assert joint.estimated_memory <= limit


def test_policies_order_memory_as_they_should(gpt):
    """Keeping everything > selective > full for what a block keeps; a recomputing block pays for it."""
    strategies = plan_sharding(gpt, MESH, PlanContext.of("h100")).strategies
    priced = {c: evaluate(gpt, MESH, strategies, PlanContext.of("h100"),
                          levers=Levers(1, {"blocks.#": BlockPolicy(c, c != "none")}))
              for c in ("none", "selective", "full")}
    saved = {c: s.estimated["saved_activation_bytes"] for c, s in priced.items()}
    assert saved["none"] > saved["selective"] > saved["full"]
    assert saved["none"] >= 3 * saved["full"]
    step = {c: s.estimated_step_time for c, s in priced.items()}
    assert step["none"] < step["selective"] < step["full"]


def test_reshard_after_forward_frees_gathered_weights_for_regathers():
    """FSDP storage on a weight-heavy model: resharding after the forward holds fewer gathered
    copies (the planner's per-copy accounting and the timeline peak, ``gather_timeline``, which
    here is the embedding's transient gather in both), at the price of gathering again."""
    with torch.device("meta"):
        model = GPT(256, 512, 4, 4, 64, False)
    ids = torch.empty(8, 64, dtype=torch.long, device="meta")
    cg = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    fsdp = {"params": {"*": ("S(0)",)}, "inputs": {0: ("S(0)",)}}
    from autoshard.passes.sharding.pins import Pins
    keep = plan_sharding(cg, MESH, PlanContext.of("h100"), pins=Pins(**fsdp), levers=LeverPins(1, "none", False))
    reshard = plan_sharding(cg, MESH, PlanContext.of("h100"), pins=Pins(**fsdp), levers=LeverPins(1, "none", True))
    assert reshard.levers.blocks["blocks.#"] == BlockPolicy("none", True)
    assert reshard.memory_breakdown["gathered_weights"] < keep.memory_breakdown["gathered_weights"]
    assert reshard.estimated["gathered_peak_bytes"] <= keep.estimated["gathered_peak_bytes"]
    assert reshard.estimated_step_time > keep.estimated_step_time


def test_lever_pins_are_honoured_and_bad_ones_named(gpt):
    sol = _plan(gpt, None, checkpoint="selective", accumulation=2)
    assert sol.levers.accumulation == 2 and sol.levers.blocks["blocks.#"] == BlockPolicy("selective", True)
    sol = _plan(gpt, None, checkpoint={"blocks.*": "full"})
    assert sol.levers.blocks["blocks.#"].checkpoint == "full"
    with pytest.raises(AutoshardError, match=r"matches no repeated-block type.*'blocks.#'"):
        _plan(gpt, None, checkpoint={"layers.#": "full"})
    with pytest.raises(AutoshardError, match="reshard_after_forward=False cannot hold"):
        _plan(gpt, None, checkpoint="full", reshard_after_forward={"blocks.#": False})
    # one False for every block type leaves the types pinned to recompute re-gathering (as they must)
    sol = _plan(gpt, None, checkpoint="full", reshard_after_forward=False)
    assert sol.levers.blocks["blocks.#"] == BlockPolicy("full", True)
    with pytest.raises(AutoshardError, match=r"accumulation=3 does not divide the global batch of 8"):
        _plan(gpt, None, accumulation=3)
    with pytest.raises(AutoshardError, match="checkpoint=.some.: choose one of"):
        LeverPins(checkpoint="some")
    with pytest.raises(AutoshardError, match="pass an int >= 1"):
        LeverPins(accumulation=0)
    with pytest.raises(AutoshardError, match="not supported"):
        MixedPrecision(param_dtype=torch.int8)


def test_nothing_fits_names_the_smallest_need_with_every_lever_applied(gpt):
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(gpt, 1e6)
    msg = str(info.value)
    need = int(re.search(r"smallest plan needs (\d+) bytes", msg).group(1))
    assert need > 1e6
    assert "accumulation=8" in msg and "checkpoint=full" in msg
    # nothing smaller exists: the largest accumulation with full checkpointing, pinned, needs as much
    pinned = _plan(gpt, None, accumulation=8, checkpoint="full")
    assert need <= pinned.estimated_memory * (1 + 1e-6)


def test_random_plans_draw_levers_and_are_priced_on_the_hardware_and_optimizer_asked_for(gpt):
    drawn = [random_solution(gpt, MESH, seed=s, levers=LeverPins()) for s in range(8)]
    assert any(d.levers.accumulation > 1 for d in drawn)
    assert len({d.levers.blocks.get("blocks.#", BlockPolicy()).checkpoint for d in drawn}) > 1
    plain = random_solution(gpt, MESH, seed=3)
    assert plain.strategies == drawn[3].strategies and not plain.levers.any_pulled
    on_cpu = random_solution(gpt, MESH, PlanContext.of("cpu", optimizer="sgd"), seed=3, levers=LeverPins())
    same = evaluate(gpt, MESH, on_cpu.strategies, PlanContext.of("cpu", optimizer="sgd"), levers=on_cpu.levers)
    assert on_cpu.estimated_step_time == pytest.approx(same.estimated_step_time, rel=1e-12)
    assert on_cpu.estimated_step_time > 10 * drawn[3].estimated_step_time  # a CPU is far slower than an H100
    assert on_cpu.memory_breakdown["optimizer"] == 0
    # the front door too (it used to price a random plan on h100 with AdamW whatever was asked)
    # (it plans the captured program as the one that runs: the microstep count stays 1 there)
    front = plan_captured(gpt, MESH, hardware="cpu", optimizer="sgd", random_seed=3)
    assert front.solution.strategies == on_cpu.strategies and front.solution.levers.accumulation == 1
    same = evaluate(gpt, MESH, front.solution.strategies, PlanContext.of("cpu", optimizer="sgd"),
                    levers=front.solution.levers)
    assert front.estimated_step_time == pytest.approx(same.estimated_step_time, rel=1e-12)
    assert front.estimated_step_time > 10 * drawn[3].estimated_step_time


def test_a_program_traced_at_the_microbatch_plans_like_the_global_one_cut_into_microsteps():
    """What compile does for accumulation: trace one microstep and plan it with the levers pinned;
    the plan and its price equal the global-batch plan's (the time within 0.1%: pricing the global
    program per microstep divides a memory-bound op's whole traffic by k, parameter reads included)."""
    with torch.device("meta"):
        model = GPT(256, 128, 2, 4, 256, False)
    ids = torch.empty(8, 256, dtype=torch.long, device="meta")
    whole = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    micro = capture(model, (ids[:4],), loss_fn=lm_loss, target=ids[:4])
    pins = LeverPins(accumulation=2, checkpoint="selective")
    a = plan_sharding(whole, MESH, PlanContext.of("h100"), levers=pins)
    b = plan_sharding(micro, MESH, PlanContext.of("h100"), levers=pins, traced_at_microbatch=True)
    assert a.levers == b.levers
    assert b.estimated_step_time == pytest.approx(a.estimated_step_time, rel=1e-3)
    assert b.estimated_memory == pytest.approx(a.estimated_memory, rel=1e-6)
    assert b.param_placements == a.param_placements
