"""Random valid plans, for randomized equivalence tests of the runtime: a random strategy per node
(pins respected) and random memory levers, priced with ``solution.evaluate`` like a solved plan.
"""
from __future__ import annotations

import random
from typing import Optional

from autoshard.passes.solve.context import PlanContext
from autoshard.passes.graph import CapturedGraph, operands
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.clustering import output_slot
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.lever_search import LeverSearch
from autoshard.passes.solve.microbatch import global_batch, strategies_granularity
from autoshard.passes.solve.solution import Solution, evaluate
from autoshard.passes.spec import Partial, Replicate, Strategy

__all__ = ["random_solution"]


def random_solution(captured: CapturedGraph, mesh, ctx: Optional[PlanContext] = None, *, seed: int,
                    pins: Optional[Pins] = None, levers: Optional[LeverPins] = None,
                    traced_at_microbatch: bool = False, storage_forms: bool = True) -> Solution:
    """A random valid strategy per node (pins respected), and random memory levers, priced like a
    solved plan on ``ctx``'s hardware with its optimizer (None: the default context).
    ``traced_at_microbatch``: as in ``plan_sharding``
    (``captured`` holds one microstep of the pinned ``levers.accumulation``).

    Half the time an op takes a strategy whose operand placements match what its producers chose
    (so sharded chains form); strategies that turn a non-P operand into P are avoided when possible.
    ``levers`` (None: none pulled): each free block policy is drawn among the allowed ones, and the
    microstep count among the divisors of the batch that the drawn strategies still divide (a
    pinned count narrows the strategies first); mixed precision is as given. The levers are drawn
    after the strategies from a generator of their own, so a seed draws the same strategies with
    or without them. ``storage_forms``: parameters may take ZeRO-1/2 and reduce-once forms too
    (``passes.sharding.storage_forms``; a random plan always runs without a pipeline).
    """
    forms = storage_forms
    levers = LeverPins.off() if levers is None else levers
    ctx = PlanContext.given(ctx)
    search = LeverSearch(captured, mesh, ctx, pins, levers, traced_at_microbatch, forms)
    mesh, table, allowed = search.choices
    if levers.accumulation not in (None, 1) and not traced_at_microbatch:
        allowed = search.problem(levers.accumulation)[0].allowed
    rng = random.Random(seed)
    chosen: dict[str, Strategy] = {}
    replicated = tuple(Replicate() for _ in mesh.shape)  # what a get_attr constant holds
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        options = [table[node.name][k] for k in sorted(allowed.get(node.name, range(len(table[node.name]))))]
        if node.op == "call_function" and len(options) > 1:
            have = [chosen[o.node.name].outputs[output_slot(o.node, o.index)] if o.node.name in chosen
                    else replicated for o in operands(node)]
            sane = [s for s in options if not any(isinstance(p, Partial) and not isinstance(h[a], Partial)
                                                  for pls, h in zip(s.inputs, have) for a, p in enumerate(pls))]
            options = sane or options
            match = [s for s in options if all(tuple(a) == tuple(b) for a, b in zip(s.inputs, have))]
            if match and rng.random() < 0.5:
                options = match
        chosen[node.name] = rng.choice(options)
    draw = random.Random(f"levers-{seed}")
    policies = {t: draw.choice(allowed_policies) for t, allowed_policies in sorted(search.policies.items())}
    ks = search.accumulations()
    if len(ks) > 1:
        grain = strategies_granularity(captured, chosen, mesh)
        batch = global_batch(captured)
        ks = [k for k in ks if (batch // k) % grain == 0]
    k = draw.choice(ks)
    stats = {"status": f"RANDOM(seed={seed})"}
    search.warn_if_coupled(k, stats)
    return evaluate(captured, mesh, chosen, ctx, unruled=table.unruled, levers=search.levers_of(k, policies),
                    solver_stats=stats, traced_at_microbatch=traced_at_microbatch)
