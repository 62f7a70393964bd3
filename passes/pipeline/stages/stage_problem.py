"""One pipeline configuration to cut into stages, and the closed-form price of a given cut.

``StageProblem`` holds the per-unit data of ``stage_ilp``'s formulation (its module docstring names
the symbols and constraints); ``stage_costs``, ``stage_memory_terms`` and ``group_memory`` evaluate a
cut in floating point with the ILP's own formulas, ``pipeline_step_time`` is its closed-form step
(the ILP's objective), and ``priced_solution`` packages a cut as a ``StageSolution``. The heuristic
cuts (``stage_cuts``) and the ILP (``stage_ilp``) both price their answers here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["StageProblem", "StageSolution", "pipeline_step_time", "stage_costs", "stage_memory_terms",
           "stage_memory_record", "group_memory", "priced_solution", "every_group_holds_params", "fits_memory"]


def pipeline_step_time(stage_times: Sequence[float], stage_group: Sequence[int], m: int, v: int,
                       grad_sync: Sequence[float] = ()) -> float:
    """Closed-form step time: (m - 1/v) max_g T_g + sum_s t_s / v + max_g G_g, where T_g / G_g sum
    the per-microbatch times / per-step gradient syncs of the stages on group g (``stage_group[s]``)."""
    groups: dict[int, float] = {}
    syncs: dict[int, float] = {0: 0.0}
    for s, g in enumerate(stage_group):
        groups[g] = groups.get(g, 0.0) + stage_times[s]
        if grad_sync:
            syncs[g] = syncs.get(g, 0.0) + grad_sync[s]
    return (m - 1.0 / v) * max(groups.values()) + sum(stage_times) / v + max(syncs.values())


@dataclass
class StageProblem:
    """One configuration to cut (see module docstring for the symbols). ``cut_seconds[c]`` /
    ``cut_bytes[c]`` belong to the cut after unit c (L - 1 entries). ``stage_group[s]``: the rank
group running stage s (its length is the number of stages S); ``held[s]``: microbatches whose
activations stage s holds at its peak under the schedule (k_s). ``recompute``: None lets the
    solver choose per stage; True / False pins every stage. ``starts``: pinned first units of stages
    1..S-1 (None: free). ``holds_params[l]``: unit l reads a parameter (None: no constraint (6)).
    ``grads[l]``, ``opt_fixed[l]``, ``opt_peak[l]``: unit l's gradient bytes, optimizer-step bytes that
    add up over a stage (step counters; foreach temporaries) and that a stage takes the largest of
    (for-loop AdamW's two copies of its largest parameter): given, memory is the step peak (3')."""
    fwd: list[float]
    bwd: list[float]
    grad_sync: list[float]
    state: list[float]
    act: list[float]
    cut_seconds: list[float]
    cut_bytes: list[float]
    stage_group: list[int]
    held: list[int]
    m: int
    memory_limit: float
    recompute: Optional[bool] = None
    starts: Optional[list[int]] = None
    holds_params: Optional[list[bool]] = None
    grads: Optional[list[float]] = None
    opt_fixed: Optional[list[float]] = None
    opt_peak: Optional[list[float]] = None
    #: per unit, what follows its group's gradient sync each step: the optimizer's update of its
    #: parameters (its gradient accumulations are in ``bwd``: ``scoring.accumulation_share``); whether
    #: the gradient all-reduces overlap the backward still running (else they start when the group's
    #: backward ends)
    opt_step: Optional[list[float]] = None
    overlap_sync: bool = True
    #: per rank group, the schedule's moments (``schedule.held_moments``: the stage that runs, and how
    #: many microbatches each of the group's stages holds then); given, a group's memory is its peak over
    #: them (``group_memory``), not the sum of its stages' own peaks at ``held``
    moments: Optional[tuple] = None
    #: per cut, seconds its send holds the sending rank's stream when sends block (separate blocking
    #: send calls, ``scoring.send_seconds``); None: sends are posted and cost the sender nothing
    send_seconds: Optional[list[float]] = None
    #: per cut, DeepSpeed's partitioned boundaries (``partitioned_tensors``): seconds the sending stage's
    #: backward spends gathering its own output again, and seconds a sender spends cutting its piece
    #: out of each send (its output forward, its input's gradient backward); None: neither
    regather_seconds: Optional[list[float]] = None
    piece_copy_seconds: Optional[list[float]] = None

    @property
    def step_peak(self) -> bool:
        """Whether stage memory is the whole-step peak (3') rather than states + held activations (3)."""
        return self.grads is not None

    @property
    def num_stages(self) -> int:
        return len(self.stage_group)

    @property
    def p(self) -> int:
        return len(set(self.stage_group))

    @property
    def v(self) -> int:
        return self.num_stages // self.p

    def lower_bound(self) -> float:
        """A step time no cut can beat: perfectly balanced groups, no recompute, free p2p."""
        work = sum(self.fwd) + sum(self.bwd)
        return (self.m - 1.0 / self.v) * work / self.p + work / self.v + sum(self.grad_sync) / self.p

    def memory_lower_bound(self) -> float:
        """Bytes per device that the busiest rank group needs under every cut and recompute choice
        (``group_memory``'s terms, dropping only non-negative ones): a stage holds at least its
        units' states (and, for (3'), gradients) and, holding a microbatch, one microbatch's
        activations of them, recomputing or not; the optimizer side at least its states and fixed
        temporaries. Every unit sits on some group, so the busiest holds at least the average over
        the p groups and at least any one unit's share. Above the limit, no cut fits: a proof, for
        free, where the stage ILP can spend seconds finding it."""
        acts = self.act if min(self.held, default=0) >= 1 else [0.0] * len(self.act)
        grads = self.grads if self.step_peak else [0.0] * len(self.act)
        per_unit = [w + a + g for w, a, g in zip(self.state, acts, grads)]
        # over moments, only the running stage surely holds a microbatch and makes gradients
        spread = self.state if self.moments is not None else per_unit
        bound = max(sum(spread) / self.p, max(per_unit, default=0.0))
        if self.step_peak:
            opt = [w + o for w, o in zip(self.state, self.opt_fixed)]
            bound = max(bound, sum(opt) / self.p, max((o + k for o, k in zip(opt, self.opt_peak)), default=0.0))
        return bound


@dataclass
class StageSolution:
    """Result for one configuration: ``starts[s]`` first unit of stage s; per-stage recompute,
    per-microbatch time, per-step gradient sync, peak memory (bytes of the stage's group share)."""
    starts: list[int]
    recompute: list[bool]
    stage_time: list[float]
    stage_sync: list[float]
    memory: list[float]
    step_time: float
    status: str
    wall_s: float
    stats: dict = field(default_factory=dict)
    #: per stage, (idle, per held microbatch, running, optimizer) bytes (``stage_memory_record``)
    records: list = field(default_factory=list)

    def ranges(self, num_units: int) -> list[range]:
        ends = self.starts[1:] + [num_units]
        return [range(a, b) for a, b in zip(self.starts, ends)]


def stage_costs(prob: StageProblem, starts: Sequence[int], recompute: Sequence[bool]
                ) -> tuple[list[float], list[float], list[float]]:
    """(per-microbatch time, per-step gradient sync, memory) of every stage of a given cut, in
    floating point: the same formulas as the ILP's constraints (2)-(3)."""
    L = len(prob.fwd)
    ends = list(starts[1:]) + [L]
    times, syncs, mems = [], [], []
    for s, (a, b) in enumerate(zip(starts, ends)):
        q_in = prob.cut_seconds[a - 1] if a > 0 else 0.0
        q_out = prob.cut_seconds[b - 1] if b < L else 0.0
        f, bw = sum(prob.fwd[a:b]), sum(prob.bwd[a:b])
        times.append(f + bw + (f if recompute[s] else 0.0) + q_in + q_out)
        syncs.append(sum(prob.grad_sync[a:b]))
        mems.append(max(stage_memory_terms(prob, a, b, recompute[s], s)))
    return times, syncs, mems


def stage_memory_terms(prob: StageProblem, a: int, b: int, recompute: bool, s: int) -> tuple[float, float]:
    """(in-step peak, optimizer-step peak) of stage ``s`` holding units a..b-1: constraint (3), or
    with the step-peak terms given, the two sides of (3') (the optimizer side 0 without them)."""
    L = len(prob.fwd)
    acts = sum(prob.act[a:b])
    x_in = prob.cut_bytes[a - 1] if a > 0 else 0.0
    held = prob.held[s] * x_in + acts if recompute else prob.held[s] * acts
    state = sum(prob.state[a:b])
    if not prob.step_peak:
        return state + held, 0.0
    x_out = prob.cut_bytes[b - 1] if b < L else 0.0
    return (state + held + sum(prob.grads[a:b]) + x_in + x_out,
            state + sum(prob.opt_fixed[a:b]) + max(prob.opt_peak[a:b], default=0.0) + x_in)


def stage_memory_record(prob: StageProblem, a: int, b: int, recompute: bool) -> tuple[float, float, float, float]:
    """(idle, per held microbatch, running, optimizer) bytes of a stage holding units a..b-1: the terms
    of its group's peak over the schedule's moments (``passes.pipeline.group_peak``), as the runtime
    re-solve's ``stage_peak.stage_memory_record`` splits its stage: idle, its states, its accumulated
    gradients (alive from the stage's first backward to the optimizer step, whichever stage of the group
    runs) and its p2p buffers: what it sent for every microbatch of the step (its outputs and its inputs'
    gradients, kept until the step's last send is done) and one microbatch's receives; per microbatch,
    its activations (recomputing: its received inputs); running, a recomputing stage's one microbatch of
    activations. With k microbatches held, idle + k x per microbatch + running is ``stage_memory_terms``'
    in-step peak, but for the m sent microbatches' buffers."""
    L = len(prob.fwd)
    acts = sum(prob.act[a:b])
    x_in = prob.cut_bytes[a - 1] if a > 0 else 0.0
    state = sum(prob.state[a:b])
    per = x_in if recompute else acts
    again = acts if recompute else 0.0
    if not prob.step_peak:
        return state, per, again, 0.0
    x_out = prob.cut_bytes[b - 1] if b < L else 0.0
    return (state + sum(prob.grads[a:b]) + (prob.m + 1) * (x_in + x_out), per, again,
            state + sum(prob.opt_fixed[a:b]) + max(prob.opt_peak[a:b], default=0.0) + x_in)


def group_memory(prob: StageProblem, starts: Sequence[int], recompute: Sequence[bool]) -> dict[int, float]:
    """Per rank group, the peak of its stages together: the larger of their in-step peaks' sum and
    their optimizer-step peaks' sum (the ILP's constraint (3) / (3'), in floating point); with the
    schedule's ``moments``, the in-step side is the group's peak over them (``stage_memory_record``)."""
    ends = list(starts[1:]) + [len(prob.fwd)]
    in_step: dict[int, float] = {}
    optimizer: dict[int, float] = {}
    records = {}
    for s, (a, b) in enumerate(zip(starts, ends)):
        g = prob.stage_group[s]
        x, y = stage_memory_terms(prob, a, b, recompute[s], s)
        in_step[g] = in_step.get(g, 0.0) + x
        optimizer[g] = optimizer.get(g, 0.0) + y
        records[s] = stage_memory_record(prob, a, b, recompute[s])
    if prob.moments is not None:
        for g in in_step:
            idle = sum(r[0] for s, r in records.items() if prob.stage_group[s] == g)
            in_step[g] = max(idle + sum(k * records[t][1] for t, k in counts) + records[stage][2]
                             for stage, counts in prob.moments[g])
    return {g: max(in_step[g], optimizer[g]) for g in in_step}


def priced_solution(prob: StageProblem, starts: list[int], recompute: list[bool], status: str, wall: float,
                    stats: Optional[dict] = None) -> StageSolution:
    """The ``StageSolution`` of the cut ``starts`` with per-stage ``recompute``, priced by ``stage_costs``
    and ``pipeline_step_time`` (``status``, ``wall`` and ``stats`` say how it was found)."""
    times, syncs, mems = stage_costs(prob, starts, recompute)
    step = pipeline_step_time(times, prob.stage_group, prob.m, prob.v, syncs)
    ends = list(starts[1:]) + [len(prob.fwd)]
    records = [stage_memory_record(prob, a, b, r) for a, b, r in zip(starts, ends, recompute)]
    return StageSolution(list(starts), list(recompute), times, syncs, mems, step, status, wall, stats or {}, records)


def every_group_holds_params(prob: StageProblem, starts: Sequence[int]) -> bool:
    """Constraint (6) for a given cut (``starts[0] == 0``)."""
    flags = prob.holds_params
    if not flags or not any(flags):
        return True
    bounds = list(starts) + [len(prob.fwd)]
    held = {g: False for g in prob.stage_group}
    for s, g in enumerate(prob.stage_group):
        held[g] = held[g] or any(flags[bounds[s]:bounds[s + 1]])
    return all(held.values())


def fits_memory(prob: StageProblem, sol: StageSolution) -> bool:
    """Whether every rank group of ``sol`` fits ``prob``'s memory limit (``group_memory``)."""
    return max(group_memory(prob, sol.starts, sol.recompute).values()) <= prob.memory_limit
