"""Stage planner (automatic 3D parallelism): layer profiles, the stage ILP, the search and its pins.

One process, meta-device models. The 6.7B test traces two blocks and stands them for 32 (identical
blocks share costs; ``profile_candidates(blocks=32)``)."""
import dataclasses
import itertools
import math

import pytest
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.errors import AutoshardError, InfeasiblePlanError
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.generators import generate
from autoshard.passes.pipeline.stages.candidate_plan import plan_submesh
from autoshard.passes.pipeline.stages.layer_costs import layer_units, profile_submesh
from autoshard.passes.pipeline.stages.planner import plan_pipeline, profile_candidates, search_stages
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.scoring import (DEFAULT_SCHEDULES, approx_held, held_microbatches, score_stages,
                                               stage_problem, valid_schedule)
from autoshard.passes.pipeline.stages.search import closed_form_best, microbatch_options, plan_candidates
from autoshard.passes.pipeline.schedule.simulate import StageCosts, simulate
from autoshard.passes.pipeline.stages.stage_cuts import even_stages
from autoshard.passes.pipeline.stages.stage_ilp import solve_stages
from autoshard.passes.pipeline.stages.stage_problem import StageProblem, group_memory, pipeline_step_time, stage_costs
from autoshard.passes.solve.planner import plan_sharding
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.pipeline.stages.candidate_plan import CandidateSpec
from autoshard.passes.pipeline.stages.search_spec import PipelinePins
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.pipeline.stages.search_spec import PipelineSearch


#: The h100 preset priced at its datasheet peaks with the link formulas (no achievable-compute model,
#: no NCCL tuner model, no communication stream): the toy-sized tests below state their premises in
#: those terms (a head worth 2.5 blocks of peak FLOPs; "every link fast" as link bandwidth and
#: latency). At these widths the calibrated model makes every kernel launch-bound
#: (``min_kernel_s``), which would test the calibration rather than the stage planner.
PEAK_H100 = dataclasses.replace(PRESETS["h100"], name="h100-peak", sm_count=0, min_kernel_s=0.0,
                                collective_model="analytic", comm_streams=0)


def _gpt(vocab, d, layers, seq, batch, dtype=torch.float32):
    with torch.device("meta"):
        model = GPT(vocab, d, layers, max(1, d // 64), seq, False).to(dtype)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())


@pytest.fixture(scope="module")
def small():
    return _gpt(vocab=512, d=128, layers=4, seq=64, batch=16)


@pytest.fixture(scope="module")
def big_head():
    # the head costs about 2.5 blocks: 2 * tokens * d * V vs a block's ~24 * tokens * d^2
    return _gpt(vocab=7680, d=256, layers=8, seq=128, batch=16)


def test_units_and_profile_add_up_to_the_core_estimate(small):
    units = layer_units(small)
    assert [u.name for u in units] == ["embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    ops = [n.name for n in small.gm.graph.nodes if n.op == "call_function"]
    assert [n for u in units for n in u.nodes] == ops  # contiguous slices, graph order, nothing lost
    for shape in [(2, 2), (4, 1)]:
        sol = plan_sharding(small, Mesh(shape), PlanContext.of(PEAK_H100))
        prof = profile_submesh(small, sol, PlanContext.of(PEAK_H100), units=units)
        time_1 = sum(c.fwd(1) + c.bwd(1) + c.grad_sync + c.opt_step for c in prof.costs)
        mem_1 = sum(c.state_bytes + c.act(1) for c in prof.costs)
        assert time_1 == pytest.approx(sol.estimated_step_time, rel=1e-9)
        # the stage planner's memory is additive: it adds up to the categories, not to the step's peak
        assert mem_1 == pytest.approx(sum(sol.memory_breakdown.values()), rel=1e-9)
        # microbatching divides what follows the batch: 4 microbatches of a quarter cost less each
        assert sum(c.fwd(4) for c in prof.costs) < sum(c.fwd(1) for c in prof.costs)
        assert all(b > 0 for b in prof.cut_bytes(1))  # the residual stream crosses every cut
        deep = prof.repeat_blocks(10)
        assert len(deep.units) == 12 and len(deep.cut_fixed) == 11


def _brute_force(prob: StageProblem) -> float:
    L, S = len(prob.fwd), prob.num_stages
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), S - 1):
        options = [False, True] if prob.recompute is None else [prob.recompute]
        for rec in itertools.product(options, repeat=S):
            starts = [0, *cuts]
            times, syncs, mems = stage_costs(prob, starts, rec)
            per = {}
            for s, g in enumerate(prob.stage_group):
                per[g] = per.get(g, 0.0) + mems[s]
            if max(per.values()) <= prob.memory_limit:
                best = min(best, pipeline_step_time(times, prob.stage_group, prob.m, prob.v, syncs))
    return best


@pytest.mark.parametrize("groups,limit", [([0, 1, 2], 60.0), ([0, 1, 2], 28.0), ([0, 1, 2], 20.0),
                                          ([0, 1, 0, 1], 70.0)])
def test_stage_ilp_is_optimal_against_brute_force(groups, limit):
    fwd = [1.0, 2.0, 2.5, 2.0, 1.5, 2.0, 4.0]
    prob = StageProblem(fwd=fwd, bwd=[2 * f for f in fwd], grad_sync=[0.1 * f for f in fwd],
                        state=[3.0, 4.0, 4.0, 4.0, 4.0, 4.0, 6.0], act=[2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 1.0],
                        cut_seconds=[0.2] * 6, cut_bytes=[0.5] * 6, stage_group=groups,
                        held=[len(set(groups)) - g for g in groups], m=8, memory_limit=limit)
    want = _brute_force(prob)
    got = solve_stages(prob, time_limit_s=20)
    assert want < float("inf") and got is not None
    assert got.status == "OPTIMAL"
    assert got.step_time == pytest.approx(want, rel=1e-4)
    # at 20 only recompute fits (brute force agrees); pinning it off then has no answer
    no_recompute = dataclasses.replace(prob, recompute=False)
    assert (_brute_force(no_recompute) == float("inf")) == (limit == 20.0)
    assert any(got.recompute) == (limit == 20.0)
    assert (solve_stages(no_recompute) is None) == (limit == 20.0)


def _brute_force_step_peak(prob: StageProblem) -> float:
    """The best step time over every cut and recompute choice whose groups' whole-step peaks fit."""
    L, S = len(prob.fwd), prob.num_stages
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), S - 1):
        for rec in itertools.product([False, True], repeat=S):
            starts = [0, *cuts]
            if max(group_memory(prob, starts, rec).values()) <= prob.memory_limit:
                times, syncs, _ = stage_costs(prob, starts, rec)
                best = min(best, pipeline_step_time(times, prob.stage_group, prob.m, prob.v, syncs))
    return best


@pytest.mark.parametrize("groups,limit", [([0, 1, 2], 60.0), ([0, 1, 2], 34.5), ([0, 1, 0, 1], 80.0)])
def test_stage_ilp_constrains_the_whole_step_stage_peak(groups, limit):
    """With the step-peak terms (accumulated gradients, optimizer temporaries: a sum and a largest-of
    per stage), the ILP's answer is the brute force's over ``group_memory``, fits it, and its reported
    memory is each stage's larger side (in-step or optimizer step), above the additive form."""
    fwd = [1.0, 2.0, 2.5, 2.0, 1.5, 2.0, 4.0]
    base = StageProblem(fwd=fwd, bwd=[2 * f for f in fwd], grad_sync=[0.1 * f for f in fwd],
                        state=[3.0, 4.0, 4.0, 4.0, 4.0, 4.0, 6.0], act=[2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 1.0],
                        cut_seconds=[0.2] * 6, cut_bytes=[0.5] * 6, stage_group=groups,
                        held=[len(set(groups)) - g for g in groups], m=8, memory_limit=limit)
    prob = dataclasses.replace(base, grads=[0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5], opt_fixed=[0.1] * 7,
                               opt_peak=[0.5, 6.0, 1.0, 1.0, 1.0, 1.0, 2.0])
    want = _brute_force_step_peak(prob)
    got = solve_stages(prob, time_limit_s=20)
    assert want < float("inf") and got is not None and got.status == "OPTIMAL"
    assert got.step_time == pytest.approx(want, rel=1e-4)
    assert max(group_memory(prob, got.starts, got.recompute).values()) <= limit
    _, _, additive = stage_costs(base, got.starts, got.recompute)
    assert all(p > a for p, a in zip(got.memory, additive))


@pytest.mark.parametrize("groups", [[0, 1, 2], [0, 1, 0, 1], [0, 1, 1, 0]])
@pytest.mark.parametrize("step_peak", [False, True])
def test_the_memory_lower_bound_is_below_every_cut_and_proves_what_the_ilp_proves(groups, step_peak):
    """``memory_lower_bound`` is at most the busiest group's memory of every cut and recompute choice,
    and tight enough to matter: above the limit, the brute force finds no cut either."""
    rng = __import__("random").Random(len(groups) * 2 + step_peak)
    for trial in range(20):
        L = 6
        prob = StageProblem(fwd=[1.0] * L, bwd=[2.0] * L, grad_sync=[0.0] * L,
                            state=[rng.uniform(0, 5) for _ in range(L)], act=[rng.uniform(0, 5) for _ in range(L)],
                            cut_seconds=[0.1] * (L - 1), cut_bytes=[rng.uniform(0, 2) for _ in range(L - 1)],
                            stage_group=groups, held=[rng.randint(1, 4) for _ in groups], m=4, memory_limit=1e9)
        if step_peak:
            prob = dataclasses.replace(prob, grads=[rng.uniform(0, 2) for _ in range(L)],
                                       opt_fixed=[rng.uniform(0, 1) for _ in range(L)],
                                       opt_peak=[rng.uniform(0, 3) for _ in range(L)])
        bound = prob.memory_lower_bound()
        least = min(max(group_memory(prob, [0, *cuts], rec).values())
                    for cuts in itertools.combinations(range(1, L), len(groups) - 1)
                    for rec in itertools.product([False, True], repeat=len(groups)))
        assert 0 < bound <= least * (1 + 1e-12), (trial, bound, least)
        tight = dataclasses.replace(prob, memory_limit=0.999 * bound)
        assert _brute_force_step_peak(tight) == float("inf") and solve_stages(tight) is None


def test_the_optimizer_step_side_alone_can_refuse_a_cut():
    """A stage whose states and activations fit but whose optimizer step (AdamW's copies of its largest
    parameter) does not: the additive form accepts the cut, the step peak refuses it."""
    base = StageProblem(fwd=[1.0, 1.0], bwd=[2.0, 2.0], grad_sync=[0.0, 0.0], state=[8.0, 8.0], act=[1.0, 1.0],
                        cut_seconds=[0.0], cut_bytes=[0.0], stage_group=[0, 1], held=[1, 1], m=2,
                        memory_limit=10.0)
    assert solve_stages(base) is not None
    heavy = dataclasses.replace(base, grads=[0.0, 0.0], opt_fixed=[0.0, 0.0], opt_peak=[0.0, 4.0])
    assert solve_stages(heavy) is None
    light = dataclasses.replace(heavy, opt_peak=[0.0, 2.0])
    assert solve_stages(light) is not None


def test_infeasible_stage_problem_gives_none():
    prob = StageProblem(fwd=[1.0] * 4, bwd=[2.0] * 4, grad_sync=[0.0] * 4, state=[10.0] * 4, act=[1.0] * 4,
                        cut_seconds=[0.0] * 3, cut_bytes=[0.0] * 3, stage_group=[0, 1], held=[2, 1], m=4,
                        memory_limit=15.0)
    assert solve_stages(prob) is None


def _blocks_per_stage(plan, units):
    block_of = {n: u.block is not None for u in units for n in u.nodes}
    first = {u.nodes[0] for u in units if u.block is not None}
    return [sum(1 for n in s.nodes if n in first) for s in plan.stages], block_of


def test_expensive_head_gets_a_short_stage(big_head):
    plan = plan_pipeline(big_head, (4,), PlanContext.of(PEAK_H100, time_limit_s=60.0),
                         PipelinePins(pp=4, schedule="1f1b"))
    units = layer_units(big_head)
    blocks, _ = _blocks_per_stage(plan, units)
    assert plan.pp == 4 and sum(blocks) == 8
    assert blocks[-1] < max(blocks[:-1])  # uneven: the head's stage takes fewer blocks
    assert plan.stages[-1].nodes[-1] == units[-1].nodes[-1]
    # contiguous, in order, every op exactly once
    ops = [n.name for n in big_head.gm.graph.nodes if n.op == "call_function"]
    assert [n for s in plan.stages for n in s.nodes] == ops


def test_pins_are_respected(small):
    units = layer_units(small)
    boundary = units[3].nodes[0]
    plan = plan_pipeline(small, (4,), PlanContext.of("h100", time_limit_s=60.0),
                         PipelinePins(pp=2, schedule="interleaved-1f1b", microbatches=4, stages=[2, boundary, 5]))
    assert (plan.pp, plan.virtual, plan.schedule, plan.microbatches) == (2, 2, "interleaved-1f1b", 4)
    starts = [next(i for i, u in enumerate(units) if u.nodes[0] == s.nodes[0]) for s in plan.stages]
    assert starts == [0, 2, 3, 5]
    assert [s.group for s in plan.stages] == [0, 1, 0, 1]
    assert [s.ranks for s in plan.stages] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert plan.stages[0].solution is not None and plan.stages[0].solution.strategies
    with pytest.raises(AutoshardError, match="must divide the mesh's first axis"):
        plan_pipeline(small, (4,), PlanContext.of(time_limit_s=60.0), PipelinePins(pp=3))
    with pytest.raises(AutoshardError, match="lies inside layer unit"):
        plan_pipeline(small, (4,), PlanContext.of(time_limit_s=60.0), PipelinePins(pp=2, stages=[units[2].nodes[1]]))
    with pytest.raises(AutoshardError, match="does not divide the global batch"):
        plan_pipeline(small, (4,), PlanContext.of(time_limit_s=60.0), PipelinePins(pp=2, microbatches=3))


def test_fast_network_and_a_model_that_fits_plans_no_pipeline():
    captured = _gpt(vocab=1024, d=512, layers=4, seq=512, batch=64, dtype=torch.bfloat16)
    fast = dataclasses.replace(PEAK_H100, name="fast-ib", inter_node_bandwidth=450e9, inter_node_latency=2e-6)
    # every schedule searched: a bubble is not worth paying when every link is fast and the model fits
    # (and no optimizer step: AdamW's, priced per rank group's parameters, would favour the pipeline's halves)
    plan = plan_pipeline(captured, (2, 8), PlanContext.of(fast, optimizer="none", time_limit_s=60.0))
    assert plan.pp == 1 and len(plan.stages) == 1 and plan.microbatches == 1
    sol = plan.stages[0].solution
    assert sol.mesh.shape == (2, 8)
    # its step: compute + activation collectives, then the gradient all-reduce, overlapped with the
    # backward exactly as a pipeline stage's is (a bucket starts once its unit's backward is done)
    prof = profile_submesh(captured, sol, PlanContext.of(fast, optimizer="none"))
    compute = sum(c.fwd(1) + c.bwd(1) for c in prof.costs)
    link, done = 0.0, sum(c.fwd(1) for c in prof.costs)
    for c in reversed(prof.costs):  # the backward visits the units last to first
        done += c.bwd(1)
        if c.grad_sync > 0:
            link = max(link, done) + c.grad_sync
    assert plan.estimated_step_time == pytest.approx(max(compute, link), rel=1e-9)
    assert compute <= plan.estimated_step_time <= sol.estimated_step_time
    for schedule in (None, "1f1b"):
        forced = plan_pipeline(captured, (2, 8), PlanContext.of(fast, optimizer="none", time_limit_s=60.0),
                               PipelinePins(pp=2, schedule=schedule))
        assert forced.pp == 2 and forced.estimated_step_time > plan.estimated_step_time
        assert [sorted(set(r for s in forced.stages if s.group == g for r in s.ranks)) for g in (0, 1)] == \
            [list(range(8)), list(range(8, 16))]  # a node per group


def test_nothing_fits_names_what_to_relax(small):
    with pytest.raises(InfeasiblePlanError, match="memory_limit.*To relax"):
        plan_pipeline(small, (2, 2), PlanContext.of("h100", memory_limit=1e5, time_limit_s=60.0))


def _simulated(prof, p, m, schedule, virtual, ranges, recompute, mesh, hw):
    """Re-time a cut from its profile, independently of the planner's scoring code: simulate, then
    each group's gradient all-reduces, one unit at a time once the unit's last backward is done."""
    bw, lat = hw.axis_link(Mesh((p, mesh.size // p)), 0)
    cut = [x / bw + lat if x > 0 else 0.0 for x in prof.cut_bytes(m)]
    L = len(prof.units)
    f, b = [], []
    for s, rng in enumerate(ranges):
        fwd = sum(prof.costs[i].fwd(m) for i in rng)
        f.append(fwd + (cut[rng.start - 1] if rng.start > 0 else 0.0))
        # a backward after the first microbatch's also adds its gradients into the held ones
        b.append(sum(prof.costs[i].bwd(m) + (m - 1) / m * prof.costs[i].accumulate for i in rng)
                 + (fwd if recompute[s] else 0.0)
                 + (cut[rng.stop - 1] if rng.stop < L else 0.0))
    groups = [s % p for s in range(len(f))] if schedule not in ("zbv", "dualpipev") else \
        list(range(p)) + list(range(p - 1, -1, -1))
    split = schedule in ("zb-h1", "zbv", "dualpipev")
    costs = StageCosts(f=f, b=[x / 2 for x in b] if split else b, w=[x / 2 for x in b] if split else [0.0] * len(b))
    result = simulate(generate(schedule, p, m, virtual), costs)
    ready = {}
    for s, rng in enumerate(ranges):
        end = max(e for _, a, _, e in result.events if a.stage == s and a.kind in ("B", "W", "BW"))
        for i in rng:  # unit i's gradient is done once the units after it in the stage are
            earlier = sum(prof.costs[j].bwd(m) + (m - 1) / m * prof.costs[j].accumulate for j in range(rng.start, i))
            ready.setdefault(groups[s], []).append((end - (0.5 if split else 1.0) * earlier,
                                                    prof.costs[i].grad_sync))
    finish = 0.0
    for g, items in ready.items():
        link = 0.0
        for t, secs in sorted(items):
            if secs > 0:
                link = max(link, t) + secs
        # then, after its backward and its sync, the group's optimizer step
        link = max(link, max(e for _, a, _, e in result.events if groups[a.stage] == g and a.kind in ("B", "W", "BW")))
        link += sum(prof.costs[i].opt_step for s, rng in enumerate(ranges) if groups[s] == g for i in rng)
        finish = max(finish, link)
    return max(result.step_time, finish)


def _choice_simulated(choice, mesh, hw):
    return _simulated(choice.profile, choice.pp, choice.m, choice.schedule, choice.virtual,
                      choice.stages.ranges(len(choice.profile.units)), choice.stages.recompute, mesh, hw)


SLOW_IB = dataclasses.replace(PRESETS["h100"], name="slow-ib", inter_node_bandwidth=1e9)


def _plan_6p7b(batch: int, pins=None):
    """GPT-3 6.7B (32 blocks of d 4096, seq 2048, bf16, AdamW) on 2 nodes x 8 H100 whose inter-node
    link is 1 GB/s: the best of pp = 1 (any (dp, tp) over all 16) and pp = 2 (one node per stage).
    With ``pins`` only the pp = 2, in-node (8, 1) layout they force is priced."""
    captured = _gpt(vocab=50304, d=4096, layers=2, seq=2048, batch=batch, dtype=torch.bfloat16)
    mesh = Mesh((2, 8))
    if pins is None:
        # deep_chain as plan_pipeline sets it: the 31 block-to-block edges of 32 blocks, not 16 (the ILP,
        # pricing each rank group's optimizer step, otherwise takes a plan that reshards between blocks
        # and pays it 31 times in the profile: 0.223 s on (4, 2) against 0.163)
        profiles = profile_candidates(captured, mesh, [1, 2],
                                      PlanContext.of(SLOW_IB, optimizer="adamw", time_limit_s=10),
                                      PipelineSearch(blocks=32, single=True, deep_chain=True))
        assert len(profiles) == 8 and all(len(p.units) == 34 for p in profiles.values())
    else:
        sol = plan_submesh(captured, Mesh((8, 1)),
                           PlanContext.of(SLOW_IB, memory_limit=2 * SLOW_IB.memory_bytes, optimizer="adamw", time_limit_s=10),
                           CandidateSpec(microbatches=max(1, batch // 8), held=2, repeat=16, chain_repeat=31), pins=pins)
        profiles = {(2, (8, 1)): profile_submesh(captured, sol, PlanContext.of(SLOW_IB, optimizer="adamw")).repeat_blocks(32)}
    best, _ = search_stages(profiles, mesh, PlanContext.of(SLOW_IB, time_limit_s=60.0), batch)
    assert best is not None and max(best.stages.memory) <= SLOW_IB.memory_bytes
    assert best.step_time == pytest.approx(_choice_simulated(best, mesh, SLOW_IB), rel=1e-9)
    return best


DATA_PARALLEL_IN_NODE = dict(params={"*": ("R", "R")}, inputs={0: ("S(0)", "R")})


def test_gpt3_6p7b_on_slow_linked_nodes_pipelines_across_them_with_tensor_parallel_inside():
    """The slow link carries only the pipeline (pp = 2, one node per stage); inside each node the
    microbatch is NOT split: every GPU sees all of it and attention runs tensor parallel, q/k/v
    column-split so each GPU owns 1/8 of the heads. Why TP and not DP here: the global batch is 8
    sequences. Data parallel over the node's 8 GPUs leaves each rank one, so the pipeline gets one
    microbatch and its bubble is half the step; keeping the batch whole lets it run 4 microbatches
    (Narayanan et al. 2021, sec. 3.3: with a fixed global batch, more data-parallel ways means fewer
    microbatches and a bigger bubble). At 16 sequences the best is dp 2 x tp 4, from 32 on data
    parallel (the next test)."""
    best = _plan_6p7b(8)
    assert best.pp == 2 and math.prod(best.profile.mesh.shape) == 8
    # the microbatch is not split 8 ways, so the pipeline gets several microbatches ... (with the
    # calibrated GPU model the planner prefers dp 4 x tp 2 to tp 8: an eighth of each GEMM runs at a
    # worse tile and wave efficiency and pays four NCCL all-reduces per block)
    assert best.profile.batch_shard < 8 and best.m > 1
    sol = best.profile.solution
    ways = {fqn: math.prod(best.profile.mesh.shape[a] for a, p in enumerate(pls) if str(p).startswith("S"))
            for fqn, pls in sol.param_placements.items()}
    for part in ("q", "k", "v"):  # ... and the attention weights are split across the node's TP ranks
        assert ways[f"blocks.0.{part}.weight"] == ways[f"blocks.1.{part}.weight"] >= 8 // best.profile.batch_shard, \
            sol.param_placements
    # the same simulator prices the rejected layouts: data parallel inside the node (what batch 512 picks) ...
    dp_inside = _plan_6p7b(8, pins=DATA_PARALLEL_IN_NODE)
    assert dp_inside.profile.batch_shard == 8 and dp_inside.m == 1
    assert best.step_time < 0.95 * dp_inside.step_time
    # ... and data parallel across the slow link: its gradient all-reduce alone is a ring over 2 nodes
    # of 6.7e9 bf16 gradients at 1 GB/s, 2 * (1/2) * 13.4 GB / 1 GB/s = 13.4 s per step
    assert best.step_time < 13.4


@pytest.mark.slow  # a batch sweep of a 6.7B plan
def test_gpt3_6p7b_on_slow_linked_nodes_with_a_large_batch_is_data_parallel_inside_each_node():
    """At a global batch of 512 the same two nodes still pipeline across the slow link, but inside a
    node data parallel wins: a stage's replicated state (16 blocks x 2.4 GB of bf16 weights, grads
    and AdamW state, ~41 GB) plus its in-flight activations (~10 GB) fits 80 GB, m = 64 microbatches
    keep the bubble small anyway, and DP's one gradient all-reduce per step over NVLink
    (2 * 7/8 * 6.7 GB / 450 GB/s ~ 26 ms, overlapped with the backward) is far cheaper than TP's four
    activation all-reduces per block per microbatch (~2.1 s per step at this batch). Megatron-LM's
    rule (Narayanan et al. 2021, sec. 3): model-parallel only as far as memory and the bubble need."""
    best = _plan_6p7b(512)
    assert best.pp == 2 and math.prod(best.profile.mesh.shape) == 8
    assert best.profile.batch_shard == 8
    placements = {fqn: tuple(map(str, p)) for fqn, p in best.profile.solution.param_placements.items()}
    # no tensor parallel: nothing is split along the node's second axis, and every block's weight is
    # replicated; the embedding table alone may be stored split over the data axis (its lookup runs on the
    # shard: one activation all-gather per microbatch instead of a replicated table's optimizer step and
    # gradient all-reduce, priced since the candidates pay their step), never at a higher simulated step
    assert all(p[1] == "R" for p in placements.values()), placements
    assert all(p == ("R", "R") for fqn, p in placements.items() if fqn.startswith("blocks.")), placements
    if any(p != ("R", "R") for p in placements.values()):
        assert best.step_time <= _plan_6p7b(512, pins=DATA_PARALLEL_IN_NODE).step_time
    assert best.step_time < 13.4


def test_returned_plan_objective_is_the_simulated_step_time(big_head):
    mesh = Mesh((4,))
    hw = PRESETS["h100"]
    profiles = profile_candidates(big_head, mesh, [2, 4], PlanContext.of(hw, optimizer="adamw"), PipelineSearch())
    best, _ = search_stages(profiles, mesh, PlanContext.of(hw, time_limit_s=60.0), 16)
    assert best.step_time == pytest.approx(_choice_simulated(best, mesh, hw), rel=1e-9)
    # the front door's plan: map its stages back to unit ranges and simulate them
    plan = plan_pipeline(big_head, mesh, PlanContext.of(hw, time_limit_s=60.0),
                         PipelinePins(pp=best.pp, schedule=best.schedule, microbatches=best.m))
    units = layer_units(big_head)
    first = {u.nodes[0]: i for i, u in enumerate(units)}
    starts = [first[s.nodes[0]] for s in plan.stages] + [len(units)]
    ranges = [range(a, b) for a, b in zip(starts, starts[1:])]
    prof = profiles[(plan.pp, plan.stages[0].mesh.shape)]
    want = _simulated(prof, plan.pp, plan.microbatches, plan.schedule, plan.virtual, ranges,
                      [s.recompute for s in plan.stages], mesh, hw)
    assert plan.estimated_step_time == pytest.approx(want, rel=1e-9)


def test_a_candidate_that_cannot_fit_falls_back_to_the_least_memory_plan(small):
    hw = PRESETS["h100"]
    mesh = Mesh((4, 1))
    roomy = plan_submesh(small, mesh, PlanContext.of(hw, memory_limit=1e12, optimizer="adamw"),
                         CandidateSpec(microbatches=4, held=2))
    assert roomy.solver_stats["status"] == "OPTIMAL"
    # nothing fits 1 kB: the fallback is the plan needing the least memory, never replicated weights
    tight = plan_submesh(small, mesh, PlanContext.of(hw, memory_limit=1e3, optimizer="adamw"),
                         CandidateSpec(microbatches=4, held=2))
    assert tight.solver_stats["status"] == "MEMORY_FALLBACK"
    state = sum(tight.memory_breakdown[k] for k in ("params", "grads", "optimizer"))
    # replicated: each fp32 parameter with its gradient and AdamW's two moments, 4 copies of its bytes (the
    # roomy plan is no baseline: it pays its optimizer step and so shards the optimizer state, ZeRO-1/2)
    replicated = 4 * sum(GraphFacts(small, hw).tensor_outputs(n)[0].nbytes for n in small.params)
    assert state <= replicated / 3  # sharded about 4 ways (small vectors may stay whole)
    # stored sharded (FSDP) or with its gradient and optimizer state sharded (ZeRO-2: one whole copy for
    # compute, no gathered copy on top), whichever needs less
    sharded = [small.params[n] for n, s in tight.strategies.items() if n in small.params
               and (str(s.outputs[0][0]).startswith("S") or any(s.lowerings))]
    assert "blocks.0.q.weight" in sharded and "head.weight" in sharded


def test_two_pass_candidates_rank_by_closed_form_and_keep_every_candidate(big_head):
    mesh = Mesh((4,))
    hw = PRESETS["h100"]
    stats = {}
    profiles = plan_candidates(big_head, mesh, [2, 4], PlanContext.of(hw, optimizer="adamw"),
                               PipelineSearch(quick_s=2.0, thorough_s=4.0, finalists=1), stats=stats)
    plain = profile_candidates(big_head, mesh, [2, 4], PlanContext.of(hw, optimizer="adamw"), PipelineSearch())
    assert set(profiles) == set(plain) == set(stats["candidates"])
    rank = {k: closed_form_best(p, k[0], mesh, PlanContext.of(hw), 16)
            for k, p in profiles.items()}
    assert stats["finalists"] == [min(rank, key=rank.get)]
    # these small ILPs are proven optimal in the first pass: nothing to re-solve, same plans
    assert all(str(row["status"]).startswith("OPTIMAL") for row in stats["candidates"].values())
    for k in profiles:
        assert profiles[k].solution.strategies == plain[k].solution.strategies


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv", "dualpipev"])
def test_closed_form_in_flight_counts_equal_the_simulators(schedule):
    """The search's first pass fits memory with ``approx_held``; a count too high drops a layout that
    fits (zbv's second half was once counted as its first), one too low wastes a simulation."""
    for p in (2, 3, 4, 8, 16):
        for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            if valid_schedule(schedule, p, m):
                assert approx_held(schedule, p, m) == list(held_microbatches(schedule, p, m)), (p, m)


@pytest.mark.slow  # a sweep over every even configuration
def test_search_is_never_worse_than_any_evenly_cut_configuration(big_head):
    """Every (pp, submesh, m, schedule, recompute on all / none) cut evenly by units and simulated,
    as the grid benchmark scores them: the search's answer is at least as fast as the best of them."""
    mesh = Mesh((8,))
    hw = dataclasses.replace(PRESETS["h100"], memory_bytes=2e8)  # tight: recompute and deep pipelines matter
    batch = 16
    profiles = profile_candidates(big_head, mesh, [1, 2, 4, 8], PlanContext.of(hw, optimizer="adamw"),
                                  PipelineSearch(single=True))
    best, _ = search_stages(profiles, mesh, PlanContext.of(hw, time_limit_s=60.0), batch)
    grid = math.inf
    for (p, _), prof in profiles.items():
        for schedule in DEFAULT_SCHEDULES:
            if p * get_schedule(schedule).virtual_stages > len(prof.units):
                continue
            for m in microbatch_options(batch, prof.batch_shard, p):
                if not valid_schedule(schedule, p, m):
                    continue
                prob = stage_problem(prof, (p, m, schedule), mesh, PlanContext.of(hw),
                                     list(held_microbatches(schedule, p, m)))
                for on in (False, True):
                    sol = even_stages(prob, on)
                    if sol is not None:
                        grid = min(grid, score_stages(prob, schedule, sol.starts, sol.recompute)[0])
    assert grid < math.inf and best is not None
    assert best.step_time <= grid * (1 + 1e-9)


def test_a_stage_before_the_last_is_planned_as_trained(small):
    """A stage before the loss returns activations, but its output's gradient arrives from the next
    stage: its plan prices gradients, AdamW's state and a backward (it was priced forward-only)."""
    from autoshard.passes.cost.facts import GraphFacts
    from autoshard.passes.pipeline.stages.stage_graphs import split_stages, stage_nodes_from_prefixes

    first, last = split_stages(small, stage_nodes_from_prefixes(small, ["blocks.2"]))
    assert not first.captured.loss_output and first.captured.training and last.captured.training
    assert GraphFacts(first.captured, PEAK_H100).training
    forward_only = dataclasses.replace(first.captured, receives_output_grads=False)
    trained = plan_sharding(first.captured, Mesh((1,)), PlanContext.of(PEAK_H100, time_limit_s=5))
    inference = plan_sharding(forward_only, Mesh((1,)), PlanContext.of(PEAK_H100, time_limit_s=5))
    params = trained.memory_breakdown["params"]
    assert trained.memory_breakdown["grads"] == params > 0 and trained.memory_breakdown["optimizer"] == 2 * params
    assert inference.memory_breakdown.get("grads", 0.0) == 0.0
    assert trained.estimated_step_time > 2 * inference.estimated_step_time  # the backward: about twice the forward
