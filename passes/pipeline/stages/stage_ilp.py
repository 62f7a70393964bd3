"""Stage construction as a CP-SAT ILP: contiguous layer ranges and per-stage recompute for ONE
pipeline configuration (p rank groups, v stages per group, m microbatches, a schedule). Knows
nothing about torch; ``planner.plan_pipeline`` enumerates configurations and calls ``solve_stages``.

Data (per layer unit l = 0..L-1, at this m): forward / backward seconds per microbatch f_l, b_l;
gradient all-reduce seconds per step g_l; parameter+gradient+optimizer bytes w_l; activation bytes
per microbatch a_l; for the cut after unit c, the p2p seconds q_c of sending its boundary values
(forward activation, and again its gradient backward) and their bytes x_c. Stages s = 0..S-1,
S = p v, stage s on group gamma(s) (round robin s mod p, or a V for zbv/dualpipev); k_s
microbatches in flight on stage s at its peak (the schedule simulator's count).

    variables  start_s  integer, first unit of stage s          (start_0 = 0, start_S = L)
               r_s      in {0,1}: stage s recomputes its forward in the backward
    (1) contiguity   start_{s+1} >= start_s + 1                 every stage holds >= 1 unit
    (2) stage time   t_s = sum_{l in s} (f_l + b_l) + r_s sum_{l in s} f_l + q_{start_s - 1} + q_{start_{s+1} - 1}
    (3) memory       per group g: sum_{s on g} [ sum_{l in s} w_l + (r_s ? k_s x_{start_s - 1} + A_s : k_s A_s) ] <= M
                     with A_s = sum_{l in s} a_l  (a recomputing stage keeps its inputs, plus one
                     microbatch's activations while it recomputes)
    (3') step peak   with the step-peak terms given (``StageProblem.grads``, ``opt_fixed``, ``opt_peak``),
                     each stage's memory is its whole-step peak (``stage_peak.stage_peak``), per group
                     both sums <= M (its stages' in-step peaks, their optimizer-step peaks):
                       backward   sum w_l + held_s + sum_{l in s} grad_l + x_{start_s - 1} + x_{start_{s+1} - 1}
                                  (accumulated gradients next to the microbatch's new ones; the
                                  received activations and the sent ones' gradients)
                       optimizer  sum w_l + sum_{l in s} opt_fixed_l + max_{l in s} opt_peak_l + x_{start_s - 1}
                                  (AdamW's temporaries: ``peak_timeline.optimizer_temporaries``)
    (3'') moments    with the schedule's moments given (``StageProblem.moments``: which stage runs, how many
                     microbatches each stage of its group holds), the in-step side is instead, per group
                     and moment, sum_{s on g} [sum w_l + sum grad_l + (m + 1)(x_{start_s - 1} + x_{start_{s+1} - 1})
                     + k_s(t) A_s (recomputing: k_s(t) x_{start_s - 1})] + the running stage's A_s if
                     recomputing: one stage runs at a time (``passes.pipeline.group_peak``); every stage's
                     accumulated gradients and the sends of the step's m microbatches are kept meanwhile
    (4) bottleneck   T >= sum_{s on g} t_s,   G >= sum_{s on g} sum_{l in s} g_l      for every group g
    (5) pins         start_s = pinned boundary; r_s = pinned recompute
    (6) parameters   every group's stages read at least one parameter (when any unit does): a rank
                     group without one would hand its optimizer an empty parameter list
    objective  minimize  (m v - 1) T + sum_s t_s + v G      ( = v * ``pipeline_step_time`` )

Range sums are prefix-sum differences read with element constraints at the integer boundaries,
so the model has O(S) variables whatever L is. The closed form (``pipeline_step_time``)
generalizes the flow-shop makespan of identical jobs: with v = 1 it is sum_s t_s + (m - 1) max_s t_s
(GPipe / 1F1B, Alpa's objective); with equal chunks it is (m v + p - 1) t_chunk (interleaved 1F1B).
CP-SAT needs integers: seconds and bytes are scaled so the largest total is about 1e6 units (a
micro-fraction: finer resolution only slows the proof down).
"""
from __future__ import annotations

import math
import time
from typing import Optional

from ortools.sat.python import cp_model

from autoshard.passes.pipeline.stages.stage_problem import StageProblem, StageSolution, priced_solution
from autoshard.passes.solve.work_budget import WorkBudget

__all__ = ["StageILP", "solve_stages"]

_UNITS = 1e6


class StageILP:
    """The CP-SAT model of one ``StageProblem``; one method per constraint family."""

    def __init__(self, prob: StageProblem):
        self.prob = prob
        self.model = cp_model.CpModel()
        L, S = len(prob.fwd), prob.num_stages
        self.L, self.S = L, S
        total_t = (sum(prob.fwd) * 2 + sum(prob.bwd) + 2 * sum(prob.cut_seconds)) * (prob.m * prob.v + S)
        total_t += sum(prob.grad_sync) * prob.v
        self.t_scale = _UNITS / max(total_t, 1e-30)
        biggest = sum(prob.state) + max(max(prob.held), 1) * (
            sum(prob.act) + max(prob.cut_bytes, default=0.0))
        if prob.step_peak:
            biggest += max(sum(prob.grads) + 2 * max(prob.cut_bytes, default=0.0),
                           sum(prob.opt_fixed) + max(prob.opt_peak, default=0.0))
        self.b_scale = _UNITS / max(biggest, prob.memory_limit, 1.0)

        def prefix(xs, scale):
            out, run = [0], 0.0
            for x in xs:
                run += x
                out.append(int(round(run * scale)))
            return out

        self.PT = prefix([f + b for f, b in zip(prob.fwd, prob.bwd)], self.t_scale)
        self.PF = prefix(prob.fwd, self.t_scale)
        self.PG = prefix(prob.grad_sync, self.t_scale)
        self.PW = prefix(prob.state, self.b_scale)
        self.PA = prefix(prob.act, self.b_scale)
        self.Q = [0] + [int(round(q * self.t_scale)) for q in prob.cut_seconds] + [0]  # index start_s
        self.X = [0] + [int(math.ceil(x * self.b_scale)) for x in prob.cut_bytes] + [0]
        if prob.step_peak:
            self.PGR = prefix(prob.grads, self.b_scale)
            self.PO = prefix(prob.opt_fixed, self.b_scale)
        # stage s starts at unit s at the earliest and leaves a unit for each later stage: bounds
        # contiguity (1) implies, given up front (presolve found them one stage per pass: 106 passes,
        # 3.7 s of wall time and no counted work, on a 128-stage cut)
        self.start = [self.model.new_constant(0)] + [self.model.new_int_var(s, L - S + s, f"start{s}")
                                                     for s in range(1, S)] + [self.model.new_constant(L)]
        self.r = [self.model.new_bool_var(f"recompute{s}") for s in range(S)]
        self.t: list = []

    def _at(self, table: list[int], s: int, name: str):
        """table[start_s] as a variable (a constant at the two ends)."""
        if s == 0:
            return table[0]
        if s == self.S:
            return table[self.L]
        var = self.model.new_int_var(min(table), max(table), f"{name}{s}")
        self.model.add_element(self.start[s], table, var)
        return var

    def _q(self, s: int):
        """p2p seconds of the cut in front of stage s (0 for the first stage and after the last)."""
        if s in (0, self.S):
            return 0
        var = self.model.new_int_var(0, max(self.Q), f"q{s}")
        self.model.add_element(self.start[s], self.Q, var)
        return var

    def add_contiguity(self) -> None:
        """(1) start_{s+1} >= start_s + 1."""
        for s in range(self.S):
            self.model.add(self.start[s + 1] >= self.start[s] + 1)

    def add_stage_time(self) -> None:
        """(2) t_s = work of the range + r_s * forward of the range + p2p of both cuts."""
        pt = [self._at(self.PT, s, "pt") for s in range(self.S + 1)]
        pf = [self._at(self.PF, s, "pf") for s in range(self.S + 1)]
        q = [self._q(s) for s in range(self.S + 1)]
        for s in range(self.S):
            extra = self.model.new_int_var(0, self.PF[-1], f"refwd{s}")
            self.model.add(extra == pf[s + 1] - pf[s]).only_enforce_if(self.r[s])
            self.model.add(extra == 0).only_enforce_if(~self.r[s])
            t = self.model.new_int_var(0, 2 * self.PT[-1] + self.PF[-1] + 2 * max(self.Q), f"t{s}")
            self.model.add(t == pt[s + 1] - pt[s] + extra + q[s] + q[s + 1])
            self.t.append(t)

    def add_memory(self) -> None:
        """(3) per group: states + activations held in flight (inputs only, if recomputing) <= M."""
        prob = self.prob
        pw = [self._at(self.PW, s, "pw") for s in range(self.S + 1)]
        pa = [self._at(self.PA, s, "pa") for s in range(self.S + 1)]
        x = [self._at(self.X, s, "x") for s in range(self.S)]
        x_out = x[1:] + [0]
        limit = int(math.floor(prob.memory_limit * self.b_scale))
        per_group: dict[int, list] = {}
        per_optimizer: dict[int, list] = {}
        for s in range(self.S):
            k = prob.held[s]
            held = self.model.new_int_var(0, (k + 1) * (self.PA[-1] + max(self.X)), f"held{s}")
            self.model.add(held == k * (pa[s + 1] - pa[s])).only_enforce_if(~self.r[s])
            self.model.add(held == k * x[s] + pa[s + 1] - pa[s]).only_enforce_if(self.r[s])
            if prob.step_peak:
                in_step, optimizer = self._step_peak(s, pw, held, x[s], x_out[s])
                per_group.setdefault(prob.stage_group[s], []).append(in_step)
                per_optimizer.setdefault(prob.stage_group[s], []).append(optimizer)
            else:
                per_group.setdefault(prob.stage_group[s], []).append(pw[s + 1] - pw[s] + held)
        if prob.moments is not None:  # (3''): the in-step side at each of the schedule's moments instead
            per_group = {}
            self._add_moments(pa, x, x_out, limit)
        for terms in list(per_group.values()) + list(per_optimizer.values()):
            self.model.add(sum(terms) <= limit)

    def _add_moments(self, pa: list, x: list, x_out: list, limit: int) -> None:
        """(3''), the schedule's moments given (``StageProblem.moments``): per group and moment, its
        stages' states, accumulated gradients, p2p buffers and the microbatches each holds then, plus
        (recomputing) the running stage's one microbatch of activations <= M
        (``stage_problem.stage_memory_record``, as linear expressions)."""
        prob = self.prob
        pw = [self._at(self.PW, s, "mw") for s in range(self.S + 1)]
        acts = [pa[s + 1] - pa[s] for s in range(self.S)]
        held: dict = {}

        def holding(s: int, k: int):
            if (s, k) not in held:
                var = self.model.new_int_var(0, k * (self.PA[-1] + max(self.X)), f"hold{s}_{k}")
                self.model.add(var == k * acts[s]).only_enforce_if(~self.r[s])
                self.model.add(var == k * x[s]).only_enforce_if(self.r[s])
                held[(s, k)] = var
            return held[(s, k)]

        running = []
        for s in range(self.S):
            var = self.model.new_int_var(0, self.PA[-1], f"again{s}")
            self.model.add(var == acts[s]).only_enforce_if(self.r[s])
            self.model.add(var == 0).only_enforce_if(~self.r[s])
            running.append(var)

        def kept(s: int):  # a stage's idle bytes beyond its states: accumulated gradients, p2p buffers
            if not prob.step_peak:
                return 0
            pg = self._at(self.PGR, s, "mg"), self._at(self.PGR, s + 1, "mg")
            return pg[1] - pg[0] + (prob.m + 1) * (x[s] + x_out[s])
        for g, moments in enumerate(prob.moments):
            mine = [s for s in range(self.S) if prob.stage_group[s] == g]
            idle = sum(pw[s + 1] - pw[s] + kept(s) for s in mine)
            for stage, counts in moments:
                self.model.add(idle + sum(holding(s, k) for s, k in counts if k) + running[stage] <= limit)

    def _step_peak(self, s: int, pw: list, held, x_in, x_out) -> tuple:
        """(3'): the stage's in-step and optimizer-step peaks, as linear expressions."""
        pg = self._at(self.PGR, s, "pgr"), self._at(self.PGR, s + 1, "pgr")
        po = self._at(self.PO, s, "po"), self._at(self.PO, s + 1, "po")
        state = pw[s + 1] - pw[s]
        return (state + held + pg[1] - pg[0] + x_in + x_out,
                state + po[1] - po[0] + self._largest_opt_peak(s) + x_in)

    def _largest_opt_peak(self, s: int):
        """max_{l in stage s} opt_peak_l: read from a (start_s, start_{s+1}) table; past 64 units, the
        largest of all (the safe side, a smaller model)."""
        values = [int(math.ceil(v * self.b_scale)) for v in self.prob.opt_peak]
        if not any(values):
            return 0
        if self.L > 64:
            return max(values)
        n = self.L + 1
        table = [max(values[a:b]) if a < b else 0 for a in range(n) for b in range(n)]
        index = self.model.new_int_var(0, n * n - 1, f"range{s}")
        self.model.add(index == self.start[s] * n + self.start[s + 1])
        var = self.model.new_int_var(0, max(values), f"optpeak{s}")
        self.model.add_element(index, table, var)
        return var

    def add_bottleneck(self) -> tuple:
        """(4) T >= every group's time, G >= every group's gradient sync."""
        prob = self.prob
        T = self.model.new_int_var(0, sum(self.PT[-1:]) * 3 + 2 * max(self.Q) * self.S, "T")
        G = self.model.new_int_var(0, self.PG[-1], "G")
        pg = [self._at(self.PG, s, "pg") for s in range(self.S + 1)]
        for g in sorted(set(prob.stage_group)):
            mine = [s for s in range(self.S) if prob.stage_group[s] == g]
            self.model.add(T >= sum(self.t[s] for s in mine))
            self.model.add(G >= sum(pg[s + 1] - pg[s] for s in mine))
        # redundant, for the proof: the busiest group carries at least the average
        self.model.add(prob.p * T >= sum(self.t))
        self.model.add(prob.p * G >= self.PG[-1])
        return T, G

    def add_parameters_per_group(self) -> None:
        """(6) every group's stages together read a parameter (if any unit does)."""
        prob = self.prob
        flags = prob.holds_params
        if not flags or not any(flags):
            return
        count = [0]
        for f in flags:
            count.append(count[-1] + int(bool(f)))
        pc = [self._at(count, s, "pc") for s in range(self.S + 1)]
        for g in sorted(set(prob.stage_group)):
            self.model.add(sum(pc[s + 1] - pc[s] for s in range(self.S) if prob.stage_group[s] == g) >= 1)

    def add_pins(self) -> None:
        """(5) pinned boundaries and recompute."""
        prob = self.prob
        if prob.starts is not None:
            for s, a in enumerate(prob.starts, start=1):
                self.model.add(self.start[s] == int(a))
        if prob.recompute is not None:
            for r in self.r:
                self.model.add(r == bool(prob.recompute))

    def set_objective(self, T, G) -> None:
        prob = self.prob
        self.model.minimize((prob.m * prob.v - 1) * T + sum(self.t) + prob.v * G)

    def hint_balanced(self) -> None:
        """Warm start: cut where the running work crosses multiples of total / S; no recompute."""
        total = self.PT[-1]
        prev = 0
        for s in range(1, self.S):
            want = total * s / self.S
            a = min(range(prev + 1, self.L - (self.S - s) + 1), key=lambda i: abs(self.PT[i] - want))
            self.model.add_hint(self.start[s], a)
            prev = a


def solve_stages(prob: StageProblem, *, time_limit_s: float = 10.0, workers: int = 1,
                 hint: Optional[StageSolution] = None, budget: Optional[WorkBudget] = None,
                 outcome: Optional[dict] = None) -> Optional[StageSolution]:
    """The cheapest cut of ``prob`` (closed-form step time) that fits its memory limit, or None.
    ``time_limit_s`` is a WORK limit (CP-SAT deterministic seconds, never a clock); ``budget``, when
    given, is charged the deterministic seconds the solve spent, whatever its outcome; the
    solution's ``stats["work"]`` holds them too. ``outcome``, when given, gets the solver's status
    (None is returned for INFEASIBLE, a proof, and for UNKNOWN, out of work before any cut)."""
    L, S = len(prob.fwd), prob.num_stages
    if S > L:
        return None
    t0 = time.perf_counter()
    ilp = StageILP(prob)
    ilp.add_contiguity()
    ilp.add_stage_time()
    ilp.add_memory()
    T, G = ilp.add_bottleneck()
    ilp.add_parameters_per_group()
    ilp.add_pins()
    ilp.set_objective(T, G)
    if hint is not None:
        for s, a in enumerate(hint.starts[1:], start=1):
            ilp.model.add_hint(ilp.start[s], a)
        for r, on in zip(ilp.r, hint.recompute):
            ilp.model.add_hint(r, on)
    elif prob.starts is None:
        ilp.hint_balanced()
    solver = cp_model.CpSolver()
    # a work limit (deterministic seconds, fixed seed), not a clock: the cut does not depend on the load
    solver.parameters.max_deterministic_time = float(max(time_limit_s, 0.01))
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = 0
    if workers > 1:
        solver.parameters.interleave_search = True
    solver.parameters.relative_gap_limit = 1e-4
    # presolve's probing spent the whole 2 s of work on GPT-3 175B's 8- and 16-stage cuts before any
    # search, leaving UNKNOWN where, without it, the (feasible) hint is proven optimal in 0.01 s
    solver.parameters.cp_model_probing_level = 0
    # one presolve pass, not three: the repeated fix-point passes over the element tables' encodings count
    # no deterministic time, so the work limit did not bound them, and they were ~45% of a solve's CPU on
    # Llama 3 405B's 16- to 64-stage cuts (29.8 -> 20.3 CPU s over its 6 hardest) and GPT-3 175B's 16-stage
    # ones (11.0 -> 6.5 CPU s over 8); the same cut, status and proof on every one of the 14 (pt405c)
    solver.parameters.max_presolve_iterations = 1
    status = solver.solve(ilp.model)
    wall = time.perf_counter() - t0
    work = float(solver.response_proto.deterministic_time)
    if budget is not None:
        budget.spend(work)
    if outcome is not None:
        outcome["status"] = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [int(solver.value(v)) for v in ilp.start[:-1]]
    recompute = [bool(solver.value(r)) for r in ilp.r]
    return priced_solution(prob, starts, recompute, solver.status_name(status), wall,
                    {"objective_units": solver.objective_value, "bound_units": solver.best_objective_bound,
                     "work": work})
