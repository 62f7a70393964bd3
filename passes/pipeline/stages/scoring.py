"""Scoring one pipeline configuration: the schedule simulator's step time plus the gradient sync the
backward does not hide.

A configuration is (pp groups, submesh profile, m microbatches, schedule, stage cut, recompute).
``score_stages`` turns its unit costs into per-stage F / B / W durations, times the schedule with
``simulate`` and adds the gradient all-reduce the way DDP runs it: every unit's gradient is ready
once that unit's backward of the LAST microbatch is done (earlier microbatches only accumulate), and
each rank group's all-reduces run one after another on its own link, overlapped with whatever
backward is still running (``overlapped_sync``). The step ends when the last group's compute and
its last all-reduce are done. A profile whose runtime starts the all-reduces only after the backward (``overlap_grad_sync`` False:
Megatron-LM without ``--overlap-grad-reduce``) has them all ready when its group's backward ends.
Each group's optimizer step (``UnitCost.opt_step``) follows its sync; the gradient accumulations of
microbatches after the first (``UnitCost.accumulate``) run inside their backwards (``accumulation_share``),
where autograd and Megatron-LM's gradient hooks run them, so they lengthen the warm-up and drain too.
``single_stage_step`` applies the same rule to a plan without a pipeline (one stage, one
microbatch), so "pipeline or not" compares like with like:

>>> overlapped_sync([(1.0, 0.5), (2.0, 0.5), (2.1, 0.5)])   # (ready time, seconds) per gradient
3.0
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.schedule.generators import held_per_stage, prepared
from autoshard.passes.pipeline.schedule.held_moments import held_moments
from autoshard.passes.pipeline.schedule.registry import get_schedule
from autoshard.passes.pipeline.stages.layer_costs import SubmeshProfile
from autoshard.passes.pipeline.stages.partitioned_tensors import copy_seconds, gather_copy_bytes, piece_copy_bytes
from autoshard.passes.pipeline.schedule.simulate import StageCosts, simulate
from autoshard.passes.pipeline.stages.stage_problem import StageProblem, StageSolution

from autoshard.passes.pipeline.stages.search_spec import DEFAULT_SCHEDULES, PipelineSearch

if TYPE_CHECKING:
    from autoshard.passes.solve.context import PlanContext

__all__ = ["DEFAULT_SCHEDULES", "Choice", "held_microbatches", "approx_held", "valid_schedule", "stage_problem",
           "group_moments",
           "score_stages", "busiest_rank_seconds", "step_floor", "config_floor", "overlapped_sync", "single_stage_step", "cut_seconds",
           "accumulation_share", "send_seconds", "regather_seconds", "piece_copy_seconds"]

_BACKWARD = ("B", "W", "BW")


@dataclass
class Choice:
    """One scored configuration: pp groups, the submesh profile, m, schedule, the stage cut and its
    step time (seconds, exposed gradient sync included), bubble and per-stage memory."""
    pp: int
    profile: SubmeshProfile
    m: int
    schedule: str
    stages: StageSolution
    step_time: float
    bubble_fraction: float
    held: list[int] = field(default_factory=list)

    @property
    def virtual(self) -> int:
        return get_schedule(self.schedule).virtual_stages

    def describe(self) -> str:
        sizes = [len(r) for r in self.stages.ranges(len(self.profile.units))]
        dp, tp = self.profile.mesh.shape
        return (f"pp={self.pp} dp={dp} tp={tp} m={self.m} {self.schedule} units/stage={sizes} "
                f"recompute={sum(self.stages.recompute)}/{len(sizes)} step={self.step_time:.4g}s")


def held_microbatches(schedule: str, p: int, m: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once under ``schedule``
    (the simulator's ``peak_stage``, counted by ``generators.held_per_stage``, which memoizes it)."""
    return held_per_stage(schedule, p, m)


def approx_held(schedule: str, p: int, m: int) -> list[int]:
    """In-flight microbatches per stage from the schedule's closed form (the simulator's count is
    exact; the closed forms equal it for every schedule but interleaved 1F1B, whose per-group total
    they approximate)."""
    return get_schedule(schedule).approx_held(p, m)


def valid_schedule(schedule: str, p: int, m: int) -> bool:
    """Can ``generate`` build ``schedule`` for p groups and m microbatches? (the registry's rule)"""
    return get_schedule(schedule).accepts(p, m)


def group_moments(schedule: str, p: int, m: int) -> Optional[tuple]:
    """The schedule's moments per rank group (``schedule.held_moments``) where a group holds several
    stages; None with one stage per group (its peak is then its stage's, at ``held_microbatches``)."""
    if get_schedule(schedule).virtual_stages == 1:
        return None
    return held_moments(schedule, p, m)


def stage_problem(profile: SubmeshProfile, config: tuple[int, int, str], mesh: Mesh, ctx: "PlanContext",
                  held: Sequence[int], search: "Optional[PipelineSearch]" = None,
                  moments: Optional[tuple] = None) -> StageProblem:
    """The ``StageProblem`` of one configuration ``config`` = (p rank groups, m microbatches, schedule):
    ``profile`` at m microbatches, groups of the schedule, the pipeline hop priced on the link of the mesh's
    first axis (``ctx.spec``) under ``ctx``'s memory limit; stage memory is the whole-step stage peak
    (``stage_ilp`` (3'), the per-unit form of ``stage_peak``). ``search``: its pinned ``starts`` and
    ``recompute`` (None: neither pinned). ``moments``: the schedule's (``group_moments``), which price a
    group of several stages at its worst moment rather than each stage at its own worst count."""
    p, m, schedule = config
    hw = ctx.spec
    starts, recompute = (None, None) if search is None else (search.starts, search.recompute)
    costs = profile.costs
    bw, lat = hw.axis_link(Mesh((p, mesh.size // p)), 0)
    cut_bytes = profile.cut_bytes(m)
    return StageProblem(
        fwd=[c.fwd(m) for c in costs], bwd=[c.bwd(m) + accumulation_share(c, m) for c in costs],
        grad_sync=[c.grad_sync for c in costs],
        state=[c.state_bytes for c in costs], act=[c.act(m) for c in costs],
        cut_seconds=cut_seconds(profile, m, bw, lat, hw), cut_bytes=cut_bytes,
        send_seconds=send_seconds(profile, m, bw, lat) if profile.blocking_sends else None,
        regather_seconds=regather_seconds(profile, m, hw) if _deepspeed_pieces(profile) else None,
        piece_copy_seconds=piece_copy_seconds(profile, m, hw) if _deepspeed_pieces(profile) else None,
        stage_group=get_schedule(schedule).stage_rank(p), held=list(held), m=m, memory_limit=ctx.memory_bytes,
        recompute=recompute, starts=starts, holds_params=[c.param_reads > 0 for c in costs],
        grads=[c.in_flight_grads for c in costs], opt_fixed=[c.opt_fixed for c in costs], opt_peak=[c.opt_peak for c in costs],
        opt_step=[c.opt_step for c in costs], overlap_sync=profile.overlap_grad_sync, moments=moments)


def accumulation_share(cost, m: int) -> float:
    """Seconds one backward of unit ``cost`` spends adding its gradients into the held ones, averaged
    over ``m`` microbatches. The accumulation runs inside the backward that produces the gradient
    (autograd's ``AccumulateGrad`` adds into ``.grad`` as each parameter's gradient is ready; Megatron-LM's
    local DDP adds ``param.grad`` into ``param.main_grad`` in a gradient hook, megatron/model/distributed.py),
    so it lengthens every backward after the first, and with them the pipeline's warm-up and drain: m - 1
    accumulations spread over the m backwards of a step, not paid once after the gradient sync."""
    return (m - 1) / m * cost.accumulate if m > 1 else 0.0


def cut_seconds(profile: SubmeshProfile, m: int, bw: float, lat: float, hw: Hardware) -> list[float]:
    """Seconds to send what crosses each cut (forward, or its gradient backward) between two rank
    groups: the bytes each rank holds over the link, plus its latency. With ``profile.scatter_gather``
    (Megatron-LM's scatter/gather of stage-boundary tensors, ``gather_split_1d_tensor``) what a rank
    holds whole on tp is sent as its 1/tp piece and the receiving group all-gathers it over tp; with
    ``profile.deepspeed_gathers`` that gather is DeepSpeed's ``PartitionedTensor.full()``, its copies
    included (``partitioned_tensors.gather_copy_bytes``)."""
    cut_bytes = profile.cut_bytes(m)
    tp = profile.mesh.shape[-1]
    if not profile.scatter_gather or tp == 1:
        return [x / bw + lat if x > 0 else 0.0 for x in cut_bytes]
    out = []
    for x, whole, gather in zip(cut_bytes, profile.cut_whole_bytes(m), _gather_seconds(profile, m, hw)):
        sent = x - whole + whole / tp
        out.append(sent / bw + lat + gather if x > 0 else 0.0)
    return out


def _gather_seconds(profile: SubmeshProfile, m: int, hw: Hardware) -> list[float]:
    """Per cut, seconds for a receiving rank to all-gather the pieces of what was held whole on tp
    (with DeepSpeed's ``PartitionedTensor.full()`` copies under ``profile.deepspeed_gathers``)."""
    tp = profile.mesh.shape[-1]
    cm = CostModel(profile.mesh, hw)
    out = []
    for whole in profile.cut_whole_bytes(m):
        gather = cm.collective_time("all_gather", profile.mesh.ndim - 1, whole) if whole > 0 else 0.0
        if profile.deepspeed_gathers and whole > 0:
            gather += copy_seconds(hw, gather_copy_bytes(whole, tp))
        out.append(gather)
    return out


def _deepspeed_pieces(profile: SubmeshProfile) -> bool:
    return profile.deepspeed_gathers and profile.scatter_gather and profile.mesh.shape[-1] > 1


def regather_seconds(profile: SubmeshProfile, m: int, hw: Hardware) -> list[float]:
    """Per cut, seconds the SENDING stage spends before its backward gathering its own output again
    (DeepSpeed's ``part_output.full()``, ``partitioned_tensors``): one more all-gather over tp and its
    copies per microbatch."""
    return [g if x > 0 else 0.0 for x, g in zip(profile.cut_bytes(m), _gather_seconds(profile, m, hw))]


def piece_copy_seconds(profile: SubmeshProfile, m: int, hw: Hardware) -> list[float]:
    """Per cut, seconds a sending rank spends cutting its 1/tp piece out of what it sends (DeepSpeed's
    ``_partition_tensor`` clone, ``partitioned_tensors.piece_copy_bytes``): its stage's output in the
    forward, its input's gradient in the backward."""
    tp = profile.mesh.shape[-1]
    return [copy_seconds(hw, piece_copy_bytes(whole, tp)) if x > 0 else 0.0
            for x, whole in zip(profile.cut_bytes(m), profile.cut_whole_bytes(m))]


def send_seconds(profile: SubmeshProfile, m: int, bw: float, lat: float) -> list[float]:
    """Seconds a sending rank's stream is held by each cut's send when sends block (``profile.
    blocking_sends``: a separate ``dist.send`` that returns once the transfer is done): what the rank
    sends over the link (its 1/tp piece of a tensor whole on tp under ``scatter_gather``) plus the latency."""
    tp = profile.mesh.shape[-1]
    out = []
    for x, whole in zip(profile.cut_bytes(m), profile.cut_whole_bytes(m)):
        sent = x - whole + whole / tp if profile.scatter_gather and tp > 1 else x
        out.append(sent / bw + lat if x > 0 else 0.0)
    return out


def _stage_durations(prob: StageProblem, starts: Sequence[int], recompute: Sequence[bool]
                     ) -> tuple[list[float], list[float]]:
    """Per stage, its F and B(+W) durations: its units' forward, plus receiving its input (and, when
    sends block, sending its output); its units' backward, the recomputed forward, receiving its
    output's gradient (and, when sends block, sending its input's gradient). With DeepSpeed's
    partitioned boundaries (``prob.regather_seconds``, ``prob.piece_copy_seconds``) the forward also cuts
    its output's piece out, and the backward gathers its own output again and cuts its input
    gradient's piece out."""
    L = len(prob.fwd)
    ends = list(starts[1:]) + [L]
    send, regather, piece = prob.send_seconds, prob.regather_seconds, prob.piece_copy_seconds
    f, b = [], []
    for s, (a, e) in enumerate(zip(starts, ends)):
        fwd = sum(prob.fwd[a:e])
        f.append(fwd + (prob.cut_seconds[a - 1] if a > 0 else 0.0) + (send[e - 1] if send and e < L else 0.0)
                 + (piece[e - 1] if piece and e < L else 0.0))
        b.append(sum(prob.bwd[a:e]) + (fwd if recompute[s] else 0.0) + (prob.cut_seconds[e - 1] if e < L else 0.0)
                 + (send[a - 1] if send and a > 0 else 0.0)
                 + (regather[e - 1] if regather and e < L else 0.0) + (piece[a - 1] if piece and a > 0 else 0.0))
    return f, b


def overlapped_sync(buckets: Iterable[tuple[float, float]]) -> float:
    """When the last of ``buckets`` ((ready time, seconds) gradient all-reduces sharing one link) is
    done: each starts once it is ready and the link is free, in ready order."""
    t = 0.0
    for ready, seconds in sorted(buckets):
        if seconds > 0:
            t = max(t, ready) + seconds
    return t


def _stage_buckets(bwd: Sequence[float], sync: Sequence[float], units: range, end: float, frac: float):
    """(ready, seconds) per unit of one stage whose last backward ends at ``end``: the backward runs
    the units last to first, so unit l is ready ``frac * sum(bwd of the units before l)`` early."""
    before = 0.0
    out = []
    for l in units:
        out.append((end - frac * before, sync[l]))
        before += bwd[l]
    return out


def score_stages(prob: StageProblem, schedule: str, starts: Sequence[int], recompute: Sequence[bool]
                 ) -> tuple[float, float]:
    """(step time, bubble fraction) of one cut: the simulated schedule, then every group's gradient
    all-reduces overlapped with the backward still running (module docstring).

    Stage s's forward is its units' forward plus receiving its input; its backward, its units'
    backward, the recomputed forward and receiving its output's gradient (split half input-grad B,
    half weight-grad W for the zero-bubble schedules); with blocking sends, its sends too
    (``_stage_durations``)."""
    L = len(prob.fwd)
    ends = list(starts[1:]) + [L]
    f, b = _stage_durations(prob, starts, recompute)
    split = get_schedule(schedule).split_backward
    if split:
        costs = StageCosts(f=f, b=[x / 2 for x in b], w=[x / 2 for x in b])
    else:
        costs = StageCosts(f=f, b=b, w=[0.0] * len(b))
    result = simulate(prepared(schedule, prob.p, prob.m), costs)
    last = [0.0] * len(starts)
    for _, action, _, finish in result.events:
        if action.kind in _BACKWARD and finish > last[action.stage]:
            last[action.stage] = finish
    groups: dict[int, list] = {}
    backward_done: dict[int, float] = {}
    after: dict[int, float] = {}  # the group's optimizer step, after its sync
    frac = (0.5 if split else 1.0) if prob.overlap_sync else 0.0
    for s, (a, e) in enumerate(zip(starts, ends)):
        g = prob.stage_group[s]
        groups.setdefault(g, []).extend(_stage_buckets(prob.bwd, prob.grad_sync, range(a, e), last[s], frac))
        backward_done[g] = max(backward_done.get(g, 0.0), last[s])
        after[g] = after.get(g, 0.0) + (sum(prob.opt_step[a:e]) if prob.opt_step else 0.0)
    ends_at = max(max(overlapped_sync(buckets), backward_done[g]) + after[g] for g, buckets in groups.items())
    return max(result.step_time, ends_at), result.bubble_fraction


def busiest_rank_seconds(prob: StageProblem, schedule: str, starts: Sequence[int], recompute: Sequence[bool]
                         ) -> float:
    """A lower bound on ``score_stages(prob, schedule, starts, recompute)``'s step time that needs no
    simulation: the compute of the busiest rank group, m times the F and B(+W) durations of its stages
    as ``score_stages`` builds them. The simulator runs a rank's actions one after another and
    transfers take no compute time, so no step is shorter than one rank's work (summed in another
    order, the two may differ by rounding: compare with a relative tolerance)."""
    busy: dict[int, float] = {}
    for s, (f, b) in enumerate(zip(*_stage_durations(prob, starts, recompute))):
        g = prob.stage_group[s]
        busy[g] = busy.get(g, 0.0) + prob.m * (f + b)
    return max(busy.values(), default=0.0)


def step_floor(prob: StageProblem, schedule: str, starts: Sequence[int], recompute: Sequence[bool]) -> float:
    """A lower bound on ``score_stages``' step time, tighter than ``busiest_rank_seconds``: per rank
    group, the time before it can start, its compute, and what must follow its last action; the
    largest over the groups. Compare with a relative tolerance (rounding, as above).

    - Start: every action of group g needs the forward of one of its stages, which needs the forwards
      of every stage before it on the same microbatch, one after another: nothing on g starts before
      the forwards of the stages before its first stage add up (``head``).
    - Compute: g runs its m forwards and backwards (the F and B(+W) durations ``score_stages`` builds)
      one at a time, so its last action ends no earlier than head + that work.
    - After: its last action is a backward (every forward has a later one on the same group), and
      ``score_stages`` adds the group's optimizer step (``prob.opt_step``) after its last backward. With
      a joint backward (BW, no split schedule) that backward's input gradient is then needed by every
      stage below it on the same microbatch, one after another: the step lasts at least their backward
      durations more (``tail``; a split schedule's last action may be a W nothing waits for: no tail).
    """
    L = len(prob.fwd)
    ends = list(starts[1:]) + [L]
    f, b = _stage_durations(prob, starts, recompute)
    joint = not get_schedule(schedule).split_backward
    head = [0.0]  # head[s]: the forwards of stages 0..s-1 of one microbatch, end to end
    tail = [0.0]  # tail[s]: their backwards
    for s in range(len(f)):
        head.append(head[-1] + f[s])
        tail.append(tail[-1] + b[s])
    busy: dict[int, float] = {}
    first: dict[int, int] = {}
    opt: dict[int, float] = {}
    for s, (a, e) in enumerate(zip(starts, ends)):
        g = prob.stage_group[s]
        busy[g] = busy.get(g, 0.0) + prob.m * (f[s] + b[s])
        opt[g] = opt.get(g, 0.0) + (sum(prob.opt_step[a:e]) if prob.opt_step else 0.0)
        first.setdefault(g, s)
    return max((head[first[g]] + busy[g] + max(opt[g], tail[first[g]] if joint else 0.0) for g in busy), default=0.0)


def config_floor(costs: Sequence, p: int, m: int) -> float:
    """A lower bound on the simulated step of every cut of one configuration (p rank groups, m
    microbatches, unit costs ``costs``, ``layer_costs.UnitCost``): the groups together do at least
    every unit's m forwards and backwards, its m - 1 gradient accumulations (inside the backwards,
    ``accumulation_share``) and its optimizer step, so the busiest does at least 1/p of it
    (``step_floor``; cuts add transfers and recompute, never less)."""
    return sum(m * (c.fwd(m) + c.bwd(m)) + c.opt_step + (m - 1) * c.accumulate for c in costs) / p


def single_stage_step(profile: SubmeshProfile) -> float:
    """Step time of ``profile``'s plan without a pipeline (one stage, one microbatch), its gradient
    all-reduces overlapped with its backward as ``score_stages`` does for a pipeline."""
    costs = profile.costs
    compute = sum(c.fwd(1) + c.bwd(1) for c in costs)
    buckets = _stage_buckets([c.bwd(1) for c in costs], [c.grad_sync for c in costs], range(len(costs)),
                             compute, 1.0 if profile.overlap_grad_sync else 0.0)
    return max(compute, overlapped_sync(buckets)) + sum(c.opt_step for c in costs)
