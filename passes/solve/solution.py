"""``Solution``: one strategy per node, with what the cost model says it costs. Plain data, JSON only.

>>> sol = plan_sharding(captured, Mesh.of(4))                      # doctest: +SKIP
>>> Solution.from_json(json.loads(json.dumps(sol.to_json()))) == sol   # doctest: +SKIP
True

Placements are written in short form ("S(0)", "R", "P"); nothing is ever pickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from autoshard.passes.cost.collectives import Collective
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.cost.model import CostModel, encode, gradient_precision
from autoshard.passes.cost.overlap import Overlap, compute_slowdown, overlap_step
from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.layout.gathers import fused_gather, gather_groups
from autoshard.passes.layout.redistribution import plan_redistribute
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.levers import BlockPolicy, Levers, MixedPrecision
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.strategies import unruled_ops
from autoshard.passes.solve.blocks import BlockMap, block_map
from autoshard.passes.solve.clustering import OUTPUT, output_placements
from autoshard.passes.solve.fused_gathers import fused_gather_copies, fused_gather_correction
from autoshard.passes.solve.gather_timeline import Segment, gathered_peak, segment_of
from autoshard.passes.solve.lever_costs import LeverPricer, policy_index
from autoshard.passes.solve.microbatch import MicrobatchCostModel, MicrobatchFacts
from autoshard.passes.solve.peak_timeline import peak_of
from autoshard.passes.solve.step_trace import TraceBuilder
from autoshard.passes.solve.storage_buckets import bucket_collectives
from autoshard.passes.sharding.storage_forms import holds_copies
from autoshard.passes.spec import Placement, Strategy, fmt, parse_placement
from autoshard.passes.writes import written_operands

__all__ = ["Solution", "Redistribution", "evaluate", "pricing_for", "node_policy", "CLOCK_STATS"]

#: solver statistics measured by the clock: shown by ``summary()`` in the planning process, never saved
CLOCK_STATS = ("wall_s", "solve_s")


def _pls_to_json(pls) -> list[str]:
    return [fmt(p) for p in pls]


def _pls_from_json(items) -> tuple[Placement, ...]:
    return tuple(parse_placement(p) for p in items)


@dataclass(frozen=True)
class Redistribution:
    """Operand ``operand_index`` of ``consumer`` moves from ``src`` (as ``producer`` made it) to
    ``dst`` (as the consumer's strategy needs it) through ``collectives`` (empty: a free local
    chunk, or a copy an earlier reader already made: the runtime makes one copy per (producer,
    placement), which every later reader needing that placement shares, so its collectives, and
    their backward, are listed and priced once, at the first reader). An operand the consumer
    writes in place (``passes.writes``) is also moved back to ``src`` after the op (the runtime's
    write-back, e.g. batch norm's running statistics): those collectives follow. ``consumer`` is
    "output" for the program's outputs, moved to ``clustering.output_placements``."""
    producer: str
    consumer: str
    operand_index: int
    src: tuple
    dst: tuple
    collectives: tuple[Collective, ...] = ()

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)

    def to_json(self) -> dict:
        return {"producer": self.producer, "consumer": self.consumer, "operand_index": self.operand_index,
                "src": _pls_to_json(self.src), "dst": _pls_to_json(self.dst),
                "collectives": [c.to_json() for c in self.collectives]}

    @classmethod
    def from_json(cls, d: dict) -> "Redistribution":
        return cls(str(d["producer"]), str(d["consumer"]), int(d["operand_index"]), _pls_from_json(d["src"]),
                   _pls_from_json(d["dst"]), tuple(Collective.from_json(c) for c in d["collectives"]))


@dataclass
class Solution:
    """The planner's answer for one captured program on one mesh.

    ``strategies``: node name -> Strategy, every placeholder and call_function node.
    ``param_placements``: parameter FQN (tied aliases included) -> storage placements per axis.
    ``estimated_step_time`` (s) = compute + communication + grad_sync + recompute (``time_breakdown``;
    compute includes the optimizer's update and the gradient accumulations between microsteps);
    ``estimated_memory`` (bytes on the busiest rank): the whole step's peak of live bytes
    (``peak_timeline``: forward, backward with recompute, gradient buckets, optimizer step), and
    ``memory_peak_phase`` the phase (and node) that sets it; ``memory_breakdown`` sums the bytes by
    category (params + grads + optimizer + activations, buffers under params), which are not all
    alive at once. ``unruled_ops``: sorted op names that ran
    replicated for lack of a rule. ``redistributions``: every operand whose producer's placement
    differs from what its consumer needs. ``param_grad_syncs``: parameter FQN -> its gradient
    all-reduces. ``solver_stats``: status, wall_s, variables, clusters, nodes, ...
    ``levers``: accumulation, per-block checkpoint/reshard policies, mixed precision
    (``passes.levers``; default: none pulled). With levers, ``memory_breakdown`` also has
    ``gathered_weights`` (gathered parameter copies: kept to the backward, or alive at once when
    resharded), and ``recompute`` (what a recomputing block re-creates for its backward);
    ``activations`` are the activations kept at the end of the forward, and ``time_breakdown``'s
    ``recompute`` is the forward work and collectives run again. ``estimated``: figures the runtime
    can measure, per rank (``runtime.memory_probe``): ``saved_activation_bytes`` (activations kept at
    the end of the forward, gathered parameter copies not included) and ``gathered_peak_bytes``
    (gathered parameter copies alive at once, the next block's prefetched gathers included), and
    each phase's peak (``peak_forward_bytes``, ``peak_backward_bytes``, ``peak_optimizer_step_bytes``).
    ``gather_groups``: the parameter copies the memory timeline priced, grouped as the runtime
    gathers them (``passes.layout.gathers``): per group, ``(parameter node, placements, fused)`` in
    first-reader order; in memory only (not in the JSON: a loaded plan has none).
    ``storage_collectives``: the collectives one step runs for the parameters in ZeRO forms
    (``passes.solve.storage_buckets``: per bucket its reduce-scatters, all-reduce and the all-gather
    after the optimizer step), in memory only.
    """
    mesh: Mesh
    strategies: dict[str, Strategy]
    param_placements: dict[str, tuple]
    estimated_step_time: float = 0.0
    estimated_memory: float = 0.0
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    time_breakdown: dict[str, float] = field(default_factory=dict)
    unruled_ops: list[str] = field(default_factory=list)
    redistributions: list[Redistribution] = field(default_factory=list)
    param_grad_syncs: dict[str, list[Collective]] = field(default_factory=dict)
    solver_stats: dict[str, Any] = field(default_factory=dict)
    levers: Levers = field(default_factory=Levers)
    estimated: dict[str, float] = field(default_factory=dict)
    memory_peak_phase: str = ""
    gather_groups: list = field(default_factory=list, repr=False, compare=False)
    storage_collectives: list = field(default_factory=list, repr=False, compare=False)

    def to_json(self) -> dict:
        """The plan as JSON data: the same inputs give the same bytes on any machine, so the solver's
        wall-clock seconds (``CLOCK_STATS``) stay out of it (they live on the in-memory Solution)."""
        return {
            "mesh": self.mesh.to_json(),
            "strategies": {k: s.to_json() for k, s in self.strategies.items()},
            "param_placements": {k: _pls_to_json(v) for k, v in self.param_placements.items()},
            "estimated_step_time": self.estimated_step_time,
            "estimated_memory": self.estimated_memory,
            "memory_breakdown": dict(self.memory_breakdown),
            "time_breakdown": dict(self.time_breakdown),
            "unruled_ops": list(self.unruled_ops),
            "redistributions": [r.to_json() for r in self.redistributions],
            "param_grad_syncs": {k: [c.to_json() for c in v] for k, v in self.param_grad_syncs.items()},
            "solver_stats": {k: v for k, v in self.solver_stats.items() if k not in CLOCK_STATS},
            "levers": self.levers.to_json(),
            "estimated": dict(self.estimated),
            "memory_peak_phase": self.memory_peak_phase,
        }

    @classmethod
    def from_json(cls, data: Union[dict, str]) -> "Solution":
        """Inverse of ``to_json`` (a dict, or its JSON text); PlanFormatError names what is wrong."""
        if isinstance(data, str):
            data = json.loads(data)
        try:
            return cls(
                mesh=Mesh.from_json(data["mesh"]),
                strategies={k: Strategy.from_json(v) for k, v in data["strategies"].items()},
                param_placements={k: _pls_from_json(v) for k, v in data["param_placements"].items()},
                estimated_step_time=float(data.get("estimated_step_time", 0.0)),
                estimated_memory=float(data.get("estimated_memory", 0.0)),
                memory_breakdown={k: float(v) for k, v in data.get("memory_breakdown", {}).items()},
                time_breakdown={k: float(v) for k, v in data.get("time_breakdown", {}).items()},
                unruled_ops=list(data.get("unruled_ops", [])),
                redistributions=[Redistribution.from_json(r) for r in data.get("redistributions", [])],
                param_grad_syncs={k: [Collective.from_json(c) for c in v]
                                  for k, v in data.get("param_grad_syncs", {}).items()},
                solver_stats=dict(data.get("solver_stats", {})),
                levers=Levers.from_json(data.get("levers")),
                estimated={k: float(v) for k, v in data.get("estimated", {}).items()},
                memory_peak_phase=str(data.get("memory_peak_phase", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanFormatError(f"malformed solution JSON ({type(e).__name__}: {e}); was it written by "
                                  "Solution.to_json?") from e


def evaluate(captured: CapturedGraph, mesh, strategies: dict[str, Strategy], ctx: Optional[PlanContext] = None, *,
             unruled: Optional[dict] = None,
             solver_stats: Optional[dict] = None, levers: Optional[Levers] = None,
             traced_at_microbatch: bool = False) -> Solution:
    """Price a full assignment (one Strategy per placeholder and call_function node) and its
    ``levers`` with the same cost model the ILP uses, on ``ctx``'s hardware and optimizer (None: the
    default context), and package it as a Solution.

    With ``levers.accumulation = k > 1`` the step is k microsteps of ``1/k`` of the batch each
    (``captured`` holds the global batch; ``traced_at_microbatch``: it holds one microstep already),
    the gradient syncs once per step; block policies as ``passes.solve.lever_costs`` prices them.
    Parameter copies the runtime gathers fused are priced as its flat collectives, one per segment
    and (axes, dtype) (``passes.solve.fused_gathers``): ``time_breakdown["communication"]`` is then
    less than the sum of the per-parameter ``redistributions`` it lists."""
    mesh = Mesh.of(mesh)
    ctx = PlanContext.given(ctx)
    hw, optimizer = ctx.spec, ctx.optimizer
    levers = levers or Levers()
    k = levers.accumulation
    facts, cm = pricing_for(captured, mesh, hw, optimizer, k, levers.mixed_precision, traced_at_microbatch)
    missing = [n for n in facts.kind if n not in strategies]
    if missing:
        raise PlanFormatError(f"the assignment lacks a strategy for {len(missing)} node(s), e.g. {missing[:5]}: "
                              "plan again for this program")
    blocks = block_map(captured, facts)
    pricer = LeverPricer(captured, facts, cm, blocks)
    # parameters whose gathered copies' gradients are reduced once per step (storage form ``once``)
    once = {n for n in captured.params if k > 1 and holds_copies(strategies[n])}
    zero_priced = {"grad_sync": 0.0, "communication": 0.0}  # per-parameter ZeRO prices, replaced by buckets'
    ilp_less = 0.0  # what the ILP's node-local storage-form prices differ from this evaluation by, per microstep

    by_type: dict[str, int] = {}  # block type -> its policy's index, looked up once (a node at a time cost 30 %)

    def policy(name: str) -> Optional[int]:
        btype = blocks.type_of(name) if name != OUTPUT and facts.kind[name] == "op" else None
        if btype is None:
            return None
        if btype not in by_type:
            by_type[btype] = node_policy(name, levers, blocks, facts)
        return by_type[btype]

    mem = dict.fromkeys(("params", "grads", "optimizer", "activations", "gathered_weights", "recompute"), 0.0)
    times = dict.fromkeys(("compute", "communication", "grad_sync", "recompute"), 0.0)
    gathers: dict[tuple, list] = {}  # (parameter, placement) -> [first reader, segment, bytes, kept, regathered, fused]
    position = {n.name: i for i, n in enumerate(captured.gm.graph.nodes)}
    segment = segment_of(captured, blocks)
    syncs: dict[str, list[Collective]] = {}
    weights = dict.fromkeys(("fwd", "bwd", "regather"), 0.0)  # parameter-edge communication, for overlap
    freed = pricer.freed_outputs(strategies, policy)
    trace = TraceBuilder(captured, facts, cm, blocks, strategies)
    for name in facts.kind:
        base, price = pricer.node(name, strategies[name], policy(name), freed.get(name, ()))
        trace.node(name, base, price)
        times["compute"] += base.compute
        times["communication"] += sum(c.seconds for c in base.collectives)
        times["recompute"] += price.seconds - base.seconds
        for key in ("params", "grads", "optimizer"):
            mem[key] += getattr(base, key)
        mem["activations"] += price.kept
        mem["recompute"] += price.recompute
        if facts.kind[name] == "param":
            syncs[captured.params[name]] = [replace(c, seconds=c.seconds * k) for c in base.grad_sync]
            times["grad_sync"] += sum(c.seconds for c in base.grad_sync)
            if base.collectives:  # a ZeRO form: its reductions and after-step gather, priced per bucket below
                zero_priced["grad_sync"] += sum(c.seconds for c in base.grad_sync if c.kind == "reduce_scatter")
                zero_priced["grad_sync"] += sum(c.seconds for c in base.grad_sync if c.kind == "all_reduce")
                zero_priced["communication"] += sum(c.seconds for c in base.collectives)
    out_placements = output_placements(captured, mesh.ndim)
    moves: list[Redistribution] = []
    made: set = set()  # (producer, slot, placement): the copies the runtime has made by this edge
    fused_moves: dict[tuple, tuple] = {}  # (parameter, placement) -> (flat gather axes, dtype, collectives)
    reader, stale = None, set()  # a reader that writes an operand in place: the runtime then drops its copies
    for u, slot, v, i in pricer.edges:
        if v != reader:
            made = {key for key in made if key[0] not in stale} if stale else made
            reader, stale = v, set()
        src = strategies[u].outputs[slot]
        dst = (out_placements or src) if v == OUTPUT else strategies[v].inputs[i]
        colls, price = pricer.edge(u, slot, v, i, encode(src), encode(dst), policy(v))
        priced = colls
        held_less = 0.0  # the price's seconds the held copy does not spend (not recompute either)
        if u in once:  # the copy's gradient is reduced once per step, after the last microstep
            held_less = sum(c.seconds for c in colls if c.phase == "bwd") * (1 - 1 / k)
            ilp_less += held_less
            colls = tuple(replace(c, seconds=c.seconds / k) if c.phase == "bwd" else c for c in colls)
        if v != OUTPUT and i in written_operands(facts.nodes[v]):
            stale.add(u)  # its move (and move back) is its own: never a shared copy
        elif colls or price.gather_copy:
            copy_key = (u, slot, normalize(dst, mesh.shape))
            if copy_key in made:  # the runtime made this copy for an earlier reader: this one reads it
                colls, price, held_less = (), replace(price, seconds=0.0), 0.0
            made.add(copy_key)
        trace.edge(u, slot, v, price, tuple(src), moved=bool(colls))
        comm = sum(c.seconds for c in colls)
        times["communication"] += comm
        times["recompute"] += price.seconds - comm - held_less
        if facts.kind[u] == "param":
            for c in colls:
                weights[c.phase] += c.seconds
            weights["regather"] += price.seconds - comm - held_less
        mem["activations"] += price.kept
        mem["recompute"] += price.recompute
        mem["gathered_weights"] += price.gathered + price.gathered_transient
        if price.gather_copy:
            need = normalize(dst, mesh.shape)  # the runtime's copies are per placement, size-1 axes made R
            flat = fused_gather(plan_redistribute(src, need, mesh.shape))
            fused = flat is not None
            if fused and colls:  # the copy's first maker: what its move was priced with
                fused_moves[(u, need)] = (flat[0], facts.tensor_outputs(u)[0].dtype, priced)
            entry = gathers.setdefault((u, need), [position[v], segment[v], price.gather_copy, False, False, fused])
            if position[v] < entry[0]:  # the runtime makes one copy per placement, at its first reader
                entry[:2] = position[v], segment[v]
            entry[3] = entry[3] or bool(price.gathered)
            entry[4] = entry[4] or bool(price.gathered_transient)
        if tuple(src) != tuple(dst):
            moves.append(Redistribution(u, v, i, tuple(src), tuple(dst), colls))
    # the runtime gathers a segment's fused copies in one flat collective per (axes, dtype), not one each
    # (fused sets reduced once per step are the runtime's own sets: their reductions run once, 1/k each)
    fwd_less = bwd_less = 0.0
    for held in (False, True):
        f, b = fused_gather_correction(cm, (
            [fused_moves[key] for key in members if key in fused_moves and (key[0] in once) == held]
            for members in gather_groups((e[0], e[1], key) for key, e in gathers.items())))
        fwd_less, bwd_less = fwd_less + f, bwd_less + (b / k if held else b)
    times["communication"] -= fwd_less + bwd_less
    weights["fwd"] -= fwd_less
    weights["bwd"] -= bwd_less
    # and copies their shards in and out of the flat buffers, on the compute stream (fused_gathers)
    copies = 0.0
    for held in (False, True):
        f, b = fused_gather_copies(cm, ((key, m[0], m[2]) for key, m in fused_moves.items() if (key[0] in once) == held),
                                   again=lambda key: gathers[key][4] and not gathers[key][3])
        copies += f + (b / k if held else b)
    times["compute"] += copies
    # the ZeRO parameters' reductions and gathers run per bucket (``storage_buckets``): priced as called
    zero_calls = bucket_collectives(cm, captured, strategies, k, _reduce_dtype(levers.mixed_precision)) \
        if zero_priced["communication"] else []
    by_bucket = {phase: sum(c.seconds for c in zero_calls if c.phase == phase) / k for phase in ("bwd", "step")}
    times["grad_sync"] += by_bucket["bwd"] - zero_priced["grad_sync"]
    times["communication"] += by_bucket["step"] - zero_priced["communication"]
    ilp_less += sum(zero_priced.values()) - sum(by_bucket.values())
    overlap = step_overlap(hw, facts, blocks, times, weights)
    times = {key: value * k for key, value in times.items()}  # grad syncs were priced 1/k per microstep
    estimated = {"saved_activation_bytes": mem["activations"],
                 "gathered_peak_bytes": gathered_peak(_segments(gathers.values())),
                 # what pricing the fused gathers as the runtime's flat calls took off the ILP's
                 # per-parameter price (the ILP objective is this much above the step)
                 "fused_gather_saving_s": (fwd_less + bwd_less) * k,
                 # and what the storage forms' node-local prices differ from their buckets' and edges'
                 # (``passes.cost.storage_prices``): the objective is this much above the step too
                 "storage_form_difference_s": ilp_less * k,
                 # the flat buffers' copy-in / copy-out, which the ILP does not price: the objective is
                 # this much below the step
                 "fused_gather_copies_s": copies * k,
                 **{key: value * k for key, value in overlap.to_json().items()}}
    cpu = hw.name.lower() == "cpu"  # gloo's collectives, torch's for-loop optimizer
    trace.gather_segments(gathers, staged_reduce_scatter=cpu)
    peak = peak_of(trace.finish(optimizer, foreach=not cpu, microsteps=k,
                                gathered_peak=estimated["gathered_peak_bytes"]))
    estimated.update({f"peak_{phase.replace(' ', '_')}_bytes": v for phase, v in peak.phases.items()})
    estimated["step_resident_bytes"] = peak.resident
    placements = {fqn: tuple(strategies[node].outputs[0]) for node, fqn in captured.params.items()}
    for alias, canon in captured.aliases.items():
        if canon in placements:
            placements[alias] = placements[canon]
    names = unruled if unruled is not None else unruled_ops(captured)
    return Solution(
        mesh=mesh, strategies=dict(strategies), param_placements=placements,
        estimated_step_time=sum(times.values()), estimated_memory=peak.bytes,
        memory_peak_phase=peak.phase, memory_breakdown=mem, time_breakdown=times, unruled_ops=sorted(set(names.values())),
        redistributions=moves, param_grad_syncs=syncs, solver_stats=dict(solver_stats or {}), levers=levers,
        estimated=estimated,
        gather_groups=gather_groups((e[0], e[1], (u, need, e[5])) for (u, need), e in gathers.items()),
        storage_collectives=zero_calls,
    )


def step_overlap(hw: Hardware, facts: GraphFacts, blocks: BlockMap, times: dict, weights: dict) -> Overlap:
    """One microstep re-scored by the stream model (``passes/cost/overlap.py``): parameter gathers
    prefetch, their gradient reductions and the gradient all-reduces overlap the backward; every other
    collective is exposed. ``times``: the microstep's additive breakdown; ``weights``: seconds of
    parameter-edge collectives by phase and of re-gathers in the backward."""
    fwd = bwd = 0.0
    for name, kind in facts.kind.items():
        if kind == "op":
            f, b = facts.compute(name)
            fwd, bwd = fwd + f, bwd + b
    share = fwd / (fwd + bwd) if fwd + bwd > 0 else 1.0
    weight_comm = weights["fwd"] + weights["bwd"]
    exposed = times["communication"] - weight_comm
    recompute = times["recompute"] - weights["regather"]
    L = sum(len(v) for v in blocks.types.values()) if hw.comm_streams else 0
    return overlap_step(fwd_compute=times["compute"] * share, bwd_compute=times["compute"] * (1 - share) + recompute,
                        exposed=exposed, fwd_prefetch=weights["fwd"], bwd_prefetch=weights["regather"],
                        bwd_reduce=weights["bwd"] + times["grad_sync"], blocks=L, slowdown=compute_slowdown(hw))


def _segments(gathers) -> list[Segment]:
    """The gather segments in the runtime's order (``passes.layout.gathers.gather_groups``)."""
    segments = []
    for members in gather_groups((e[0], e[1], e) for e in gathers):
        seg = [0.0] * 5
        for _, _, size, kept, regathered, fused in members:
            seg[0 if kept else 1] += size
            again = regathered and not kept
            seg[2] += size if again else 0.0
            seg[3] += size if fused else 0.0
            seg[4] += size if fused and again else 0.0
        segments.append(Segment(*seg))
    return segments


def _reduce_dtype(mp: Optional[MixedPrecision]):
    """The dtype the runtime reduces gradients in under ``mp`` (None: the graph's)."""
    return None if mp is None else (mp.reduce_dtype or mp.param_dtype)


def node_policy(name: str, levers: Levers, blocks: BlockMap, facts: GraphFacts) -> Optional[int]:
    """The policy (index into ``lever_costs.policy_space()``) that prices node ``name`` (or the program's
    output) under ``levers``: its block type's for an op in a block, else None."""
    btype = blocks.type_of(name) if name != OUTPUT and facts.kind[name] == "op" else None
    return None if btype is None else policy_index(levers.blocks.get(btype, BlockPolicy()))


def pricing_for(captured: CapturedGraph, mesh: Mesh, hardware: Hardware, optimizer: Union[str, float], k: int,
                mixed_precision: Optional[MixedPrecision] = None, traced_at_microbatch: bool = False,
                move_cache: Optional[dict] = None) -> tuple[GraphFacts, CostModel]:
    """The graph facts and cost model that price one microstep of a step cut into ``k``: the
    program's batch-dependent work and bytes divided by k (unless it was traced at the microbatch),
    gradient syncs shared by the k microsteps, gradients reduced (and, where it says so, accumulated) in
    the mixed-precision reduce dtype.
    ``move_cache``: a dict shared by the cost models of one mesh and hardware (``CostModel``)."""
    precision = gradient_precision(mixed_precision)
    facts = MicrobatchFacts(captured, hardware, k) if k > 1 and not traced_at_microbatch else GraphFacts(captured, hardware)
    if k > 1:
        return facts, MicrobatchCostModel(mesh, hardware, optimizer, k, move_cache=move_cache, **precision)
    return facts, CostModel(mesh, hardware, optimizer, move_cache=move_cache, **precision)
