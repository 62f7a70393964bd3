"""One program's lever-search context, shared by the planner (``planner.plan_sharding``) and random
plans (``random_plans.random_solution``): the strategy table (shared by every microstep count), the
block structure, the policies each block type may take, the microstep counts to try (never more
than one for a batch-coupled program, unless pinned), and each count's problem and lever graph.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import replace
from typing import Optional

from autoshard.passes.solve.context import PlanContext
from autoshard.passes.batch_coupling import BatchCouplingWarning, CoupledOp, batch_coupled_ops, describe_coupled
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import AutoshardError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import Levers, MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import PinError
from autoshard.passes.sharding.storage_forms import holds_copies, reduces_once
from autoshard.passes.solve.blocks import block_map
from autoshard.passes.solve.lever_costs import KEEP, LeverPricer, policy_space
from autoshard.passes.solve.lever_graph import LeverGraph, build_lever_graph
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.microbatch import BatchSplits, batch_divisors, global_batch
from autoshard.passes.solve.problem import ShardingProblem, build_problem, strategy_choices
from autoshard.passes.solve.solution import pricing_for

__all__ = ["LeverSearch", "MAX_POLICY_COMBINATIONS", "check_mixed_precision"]

# Fixing each block type's policy and solving once per combination is exact, and on these graphs far
# faster than the one-hot joint ILP (Llama-3 8B on (8,): 4 fixed solves of 0.1-0.25 s each against
# 4-7 s for the joint solve, whose LP relaxation is fractional in the policy); the joint ILP stays
# for programs with many block types, where the combinations multiply.
MAX_POLICY_COMBINATIONS = 16


class LeverSearch:
    """One program's planning context: the strategy table (shared by every microstep count), the
    block structure, the policies each block type may take and the microstep counts to try."""

    def __init__(self, captured: CapturedGraph, mesh, ctx: PlanContext, pins, levers: LeverPins,
                 traced_at_microbatch: bool, storage_forms: bool = False):
        hw = ctx.spec
        self.captured, self.ctx, self.hw, self.optimizer, self.levers = captured, ctx, hw, ctx.optimizer, levers
        self.traced_at_microbatch = traced_at_microbatch
        self.storage_forms = storage_forms
        self.choices = strategy_choices(captured, mesh, pins, storage_forms)
        self.mesh: Mesh = self.choices[0]
        check_mixed_precision(captured, levers.mixed_precision)
        facts = GraphFacts(captured, hw)
        self.blocks = block_map(captured, facts)
        op_types = sorted({self.blocks.type_of(n) for n in self.blocks.instance if facts.kind.get(n) == "op"})
        self.policies = levers.policies(op_types)
        self._splits: Optional[BatchSplits] = None
        self._moves: dict = {}  # priced moves, shared by every microstep count's cost model
        # each count's problem and its pricer, made once: a binding memory limit prices the fastest
        # policies' graph and then every policy's at the same count, and the published layouts ask again
        self._problems: dict[int, tuple[ShardingProblem, CostModel]] = {}
        self._pricers: dict[int, tuple[ShardingProblem, LeverPricer]] = {}
        self._last_graph: Optional[tuple] = None  # (key, problem, LeverGraph): ``lever_graph``'s last
        self.coupled: list[CoupledOp] = batch_coupled_ops(captured)

    def accumulations(self) -> list[int]:
        """The microstep counts to try: the pinned one, else the batch's divisors, or only 1 when an
        op couples the rows of a batch (accumulating would change what the step computes)."""
        if self.traced_at_microbatch:
            return [self.levers.accumulation or 1]
        if self.levers.accumulation is None and self.coupled:
            return [1]
        try:
            batch = global_batch(self.captured)
        except AutoshardError:
            if self.levers.accumulation not in (None, 1):
                raise
            return [1]
        return self.levers.accumulations(batch_divisors(self.captured), batch)

    def problem(self, k: int) -> tuple[ShardingProblem, CostModel]:
        """The problem of one of ``k`` microsteps (strategies that still divide the microbatch) and
        the cost model that prices it, built once per count (a ``PinError`` when the pins leave none)."""
        if k not in self._problems:
            self._problems[k] = self._build_problem(k)
        return self._problems[k]

    def pricer(self, problem: ShardingProblem, cm: CostModel) -> LeverPricer:
        """The ``LeverPricer`` of ``problem`` (one of ``problem()``'s), one per problem: what it works
        out once (moves, op-level recomputation) serves every lever graph built on it."""
        hit = self._pricers.get(id(problem))
        if hit is None or hit[0] is not problem:
            hit = self._pricers[id(problem)] = (problem, LeverPricer(self.captured, problem.facts, cm, self.blocks))
        return hit[1]

    def _build_problem(self, k: int) -> tuple[ShardingProblem, CostModel]:
        facts, cm = pricing_for(self.captured, self.mesh, self.hw, self.optimizer, k, self.levers.mixed_precision,
                                self.traced_at_microbatch, self._moves)

        def divisible_at_microbatch(table, mesh, allowed):
            if self._splits is None:
                self._splits = BatchSplits(self.captured, table, mesh)
            for name, keep in self._splits.allowed(k).items():
                allowed[name] = set(allowed.get(name, keep)) & keep
                if not allowed[name]:
                    raise PinError(f"the pins on {name!r} split its batch dimension more ways than a microbatch "
                                   f"of 1/{k} of the batch has rows: pin fewer ways or accumulate less")
            return allowed

        def narrow(table, mesh, allowed):
            if k > 1 and not self.traced_at_microbatch:
                allowed = divisible_at_microbatch(table, mesh, allowed)
            return free_forms(self.captured, table, allowed, k)

        return build_problem(self.captured, self.mesh, hardware=self.hw, facts=facts, narrow=narrow,
                             choices=self.choices), cm

    def graph(self, problem: ShardingProblem, cm: CostModel, limit: Optional[float]) -> LeverGraph:
        """The lever graph of ``problem`` with every policy the search allows, under ``limit``."""
        return self.lever_graph(problem, cm, self.policies, limit)

    def lever_graph(self, problem: ShardingProblem, cm: CostModel, policies: dict[str, list[int]],
                    limit: Optional[float]) -> LeverGraph:
        """``build_lever_graph`` of ``problem`` under ``policies`` and ``limit``. The last one built is
        kept: asked again for the same problem and policies (a program whose block types have one
        policy each, or none, asks for its fastest policies' graph and then for every policy's, the
        same graph), it is handed out again with ``limit`` (a copy of the graph; nodes and edges shared)."""
        key = (id(problem), tuple((t, tuple(rs)) for t, rs in sorted(policies.items())))
        if self._last_graph is not None and self._last_graph[0] == key and self._last_graph[1] is problem:
            built = self._last_graph[2]
            return replace(built, graph=replace(built.graph, memory_limit=limit))
        built = build_lever_graph(problem, self.pricer(problem, cm), policies, limit)
        self._last_graph = (key, problem, built)
        return built

    def combinations(self) -> list[Optional[tuple]]:
        """The block-type policy combinations to solve one by one, fastest policies first (each a
        sorted tuple of (block type, index into ``lever_costs.policy_space()``)); ``[None]``: one joint solve."""
        types = sorted(self.policies)
        combos = list(itertools.product(*(self.policies[t] for t in types)))
        if len(combos) > MAX_POLICY_COMBINATIONS:
            return [None]
        return [tuple(zip(types, c)) for c in sorted(combos, key=lambda c: (sum(c), c))]

    def levers_of(self, k: int, policies: dict[str, int]) -> Levers:
        return Levers(k, {t: policy_space()[r] for t, r in sorted(policies.items()) if r != KEEP},
                      self.levers.mixed_precision)

    def warn_if_coupled(self, k: int, stats: dict) -> None:
        """Record the batch-coupled ops in ``stats``, and warn when the step runs as ``k > 1``
        microsteps (only ever because the user pinned it)."""
        if not self.coupled:
            return
        stats["batch_coupled"] = describe_coupled(self.coupled, 3)
        if k > 1:
            warnings.warn(
                f"accumulation={k} changes what the step computes: batch-coupled ops see 1/{k} of the batch at a "
                f"time ({describe_coupled(self.coupled)}). The planner never chooses accumulation for such a model; "
                "leave accumulation out to keep the maths of one full batch", BatchCouplingWarning, stacklevel=4)


def free_forms(captured: CapturedGraph, table, allowed: dict, k: int) -> dict:
    """``allowed`` with the storage forms the ILP does not choose taken out where they are free (a
    pinned form stays): ``once`` (the held copies' price depends on the copies the plan gathers:
    ``held_reductions`` adds it to a finished plan), and with one microstep ``zero1``, which then runs
    exactly as its twin ``zero2`` and would only double the ILP's choices."""
    for name in captured.params:
        if name in allowed or name not in table:
            continue
        keep = {i for i, s in enumerate(table[name]) if not holds_copies(s) and (k > 1 or not reduces_once(s))}
        if len(keep) < len(table[name]):
            allowed[name] = keep
    return allowed


def check_mixed_precision(captured: CapturedGraph, mp: Optional[MixedPrecision]) -> None:
    """The program must compute in ``mp.param_dtype``: captured with ``capture(..., param_dtype=)``."""
    floating = {n.name: n.meta["autoshard.meta"].dtype for n in captured.gm.graph.nodes
                if n.name in captured.params and n.meta["autoshard.meta"].dtype.is_floating_point}
    want = None if mp is None else mp.param_dtype
    if want is not None and any(d != want for d in floating.values()):
        have = sorted({str(d) for d in floating.values()})
        raise AutoshardError(f"mixed_precision asks for compute in {want}, but the program was captured computing "
                             f"in {', '.join(have)}: capture it with capture(..., param_dtype={want}) (plan() does)")
    if captured.master_dtypes and (mp is None or mp.param_dtype is None):
        raise AutoshardError("the program was captured with cast parameters (capture(..., param_dtype=)): pass "
                             "mixed_precision=MixedPrecision(param_dtype=...) with the same dtype")
