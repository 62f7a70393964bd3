"""Per-layer cost and memory profiles of a captured program on one pipeline-stage submesh.

The stage planner sees the program as a CHAIN OF LAYER UNITS: the call_function nodes in graph
order, cut wherever a new numbered block instance begins (``blocks.3``, ``model.layers.11``; see
``passes.solve.clustering.block_instance``). Nodes outside numbered blocks join the unit before them,
except that the nodes after the last block form their own unit (final norm, head, loss), and those
before the first block form the embedding unit. Every unit is a contiguous slice of the graph, so
any cut between units is a valid stage boundary (a ``Plan``'s stages are contiguous node slices).
A program with no numbered block (a U-Net of named modules, an encoder-decoder written out) is cut
where the op graph allows it instead: ``op_cuts.op_graph_units`` picks boundaries whose live values
are few and single tensors, balancing compute.

>>> [u.name for u in layer_units(captured)]          # doctest: +SKIP
['embedding', 'blocks.0', 'blocks.1', 'head']

A ``SubmeshProfile`` prices every unit under one intra-op ``Solution`` (the core planner's plan for
the whole program on the stage's logical (dp, tp) submesh) with the core cost model, split by how
the cost scales with the microbatch count ``m`` (the global batch cut into ``m`` pieces):

    per-microbatch forward   f(m) = fwd_fixed + fwd_batch / m        (same for backward, activations)
    per step                 grad_sync, state bytes (parameters + gradients + optimizer state)

``*_batch`` is the full-global-batch amount of everything computed from the inputs (it shrinks with
the microbatch; a batch-dependent op's efficiency beyond its even split of the work, a GEMM shard's
tile and wave efficiency, is priced on one microbatch's shapes at the count the plan was chosen at,
``solution.solver_stats["microbatches"]``, and scaled to the batch: exact at that count);
``*_fixed`` is what every microbatch pays whatever its size: ops on parameters only and their
collectives (an FSDP weight gather repeats per microbatch), each op's launch overhead, and each
collective's latency and launch terms (collective time is affine in bytes, ``passes.cost.collectives.collective_seconds``). With
``m = 1`` the units of a solution chosen for the whole batch add up exactly to ``evaluate``'s step time
for it (tested).

``cut_fixed[c] / cut_batch[c]``: bytes per device of the values that cross the cut after unit
``c`` (produced at or before ``c``, read after it), at the producer's placement: what a stage
boundary there sends forward (and its gradient backward), and what a recomputing stage keeps;
``cut_whole_*``: the part of them held whole on the submesh's tp axis, which a runtime that
scatters and gathers stage boundaries (``SubmeshProfile.scatter_gather``) sends as 1/tp pieces.

``plan_submesh`` chooses that intra-op plan for a pipeline stage rather than for a whole step: the
core planner's problem (``solve.planner.build_problem``) priced per microbatch (batch-dependent
compute, collectives and activations divided by m, gradient all-reduces and each parameter's optimizer
step by m since they run once per step, (m - 1) / m of its gradient accumulation: what the stage scorer
charges the profile's ``opt_step`` and ``accumulate``) with activations counted ``held`` times (the microbatches a stage keeps in flight), under
``pp * memory_limit`` for the whole program (the stages' sum), and only with strategies that still
divide the microbatch (``solve.microbatch.microbatch_strategies``: 16 sequences split 8 ways are fine, a
microbatch of one sequence is not). Tensor parallelism then appears where data parallelism's
replicated weights would not fit, or where the batch is too small to split; when nothing fits, the
least-memory plan, never replicated weights.

Identical blocks cost the same, so a profile traced with a few blocks stands for a deep model:
``profile.repeat_blocks(96)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from autoshard.passes.solve.clustering import (OUTPUT, block_instance, cluster_edges, graph_edges, module_path,
                                               output_placements)
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel
from autoshard.passes.cost.moe import is_moe_node
from autoshard.passes.errors import InfeasiblePlanError
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.hint_plans import pinned_choices
from autoshard.passes.solve.ilp import solve
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.pins import Pins, PinError
from autoshard.passes.solve.peak_timeline import optimizer_temporaries
from autoshard.passes.solve.problem import build_problem, strategy_choices
from autoshard.passes.solve.lever_search import free_forms
from autoshard.passes.solve.step_trace import STEP_COUNTER_BYTES
from autoshard.passes.solve.solution import Solution
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.layout.redistribution import R_CODE, encode
from autoshard.passes.pipeline.stages.stage_zero import zero_step_costs
from autoshard.passes.writes import written_operands
from autoshard.passes.pipeline.stages.op_cuts import op_graph_units
from autoshard.passes.solve.microbatch import (MicrobatchCostModel, MicrobatchFacts, batch_dependent, batch_granularity,
                                               microbatch_strategies)

__all__ = ["CandidateSpec", "LayerUnit", "UnitCost", "SubmeshProfile", "layer_units", "batch_dependent", "profile_submesh",
           "submesh_shapes", "plan_submesh"]


@dataclass(frozen=True)
class LayerUnit:
    """One link of the chain: ``name`` ("embedding", "blocks.3", "head"), ``block`` (normalized block
    path such as "blocks.#", None outside numbered blocks), its call_function ``nodes`` in order."""
    name: str
    block: Optional[str]
    nodes: tuple[str, ...]


def layer_units(captured: CapturedGraph, keep: Sequence[str] = ()) -> list[LayerUnit]:
    """Cut the program's call_function nodes into contiguous layer units (see module docstring).
    ``keep``: op names that must start a unit when the cut comes from the op graph (pinned stage
    boundaries; numbered blocks ignore it)."""
    ops = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    keys = [block_instance(module_path(n, captured)) for n in ops]
    last_block = max((i for i, k in enumerate(keys) if k is not None), default=-1)
    if last_block < 0:
        return [LayerUnit(name, None, tuple(nodes)) for name, nodes in op_graph_units(captured, keep=keep)]
    units: list[tuple[str, Optional[str], list[str]]] = []
    current: Optional[str] = None
    for i, (node, key) in enumerate(zip(ops, keys)):
        if key is not None and key[1] != current:
            units.append((key[1], key[0], []))
            current = key[1]
        elif key is None and i > last_block and (not units or units[-1][0] != "head"):
            units.append(("head", None, []))
            current = "head"
        elif not units:
            units.append(("embedding", None, []))
            current = "embedding"
        units[-1][2].append(node.name)
    return [LayerUnit(name, block, tuple(nodes)) for name, block, nodes in units]


@dataclass(frozen=True)
class UnitCost:
    """One unit on one submesh: seconds per microbatch ``fixed + batch / m`` (forward, backward),
    gradient all-reduce seconds per step, parameter / gradient / optimizer-state bytes (buffers count
    as parameters), and activation bytes
    per microbatch ``act_fixed + act_batch / m`` (what autograd keeps for the backward); ``param_reads``:
    how many parameters the unit's ops read (a tied one counts for every unit reading it).
    ``opt_fixed`` / ``opt_peak``: bytes the optimizer step allocates for the unit's parameters
    (``passes.solve.peak_timeline.optimizer_temporaries``, as ``evaluate``'s step walk counts them):
    what adds up over a stage (AdamW's step counters; foreach's one copy of every parameter) and what a
    stage takes the largest of (the for-loop's two copies of its largest parameter). ``opt_step``:
    seconds of the optimizer's update of the unit's parameters (per step); ``accumulate``: seconds of
    adding one microbatch's gradients into theirs (``passes/cost/optimizer_step.py``; the scorer adds
    the step after the unit's group's gradient sync and the accumulations inside the backwards,
    ``scoring.accumulation_share``). ``held_grads``: a ``zero1`` parameter's unreduced
    gradient, held whole over the microbatches beside its reduced slice (``grads``: what one backward
    adds in flight is counted from ``grads``, as for the other forms)."""
    fwd_fixed: float = 0.0
    fwd_batch: float = 0.0
    bwd_fixed: float = 0.0
    bwd_batch: float = 0.0
    grad_sync: float = 0.0
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    act_fixed: float = 0.0
    act_batch: float = 0.0
    param_reads: float = 0.0
    opt_fixed: float = 0.0
    opt_peak: float = 0.0
    opt_step: float = 0.0
    accumulate: float = 0.0
    held_grads: float = 0.0

    @property
    def state_bytes(self) -> float:
        return self.params + self.grads + self.optimizer + self.held_grads

    def fwd(self, m: int) -> float:
        return self.fwd_fixed + self.fwd_batch / m

    def bwd(self, m: int) -> float:
        return self.bwd_fixed + self.bwd_batch / m

    def act(self, m: int) -> float:
        return self.act_fixed + self.act_batch / m


@dataclass
class SubmeshProfile:
    """Every unit's cost on one logical submesh (see module docstring); ``solution`` is the intra-op
    plan priced (of the traced program: after ``repeat_blocks`` the units outnumber the traced ones).
    ``batch_shard``: the smallest microbatch, in sequences, the plan stays valid for; microbatch
    sizes must be multiples of it (``solve.microbatch.batch_granularity``)."""
    mesh: Mesh
    units: list[LayerUnit]
    costs: list[UnitCost]
    cut_fixed: list[float]
    cut_batch: list[float]
    solution: Optional[Solution] = None
    batch_shard: int = 1
    stats: dict = field(default_factory=dict)
    #: the gradient all-reduces start under the backward still running (PyTorch DDP's buckets; Megatron
    #: with --overlap-grad-reduce), or only once a rank group's backward is done (False)
    overlap_grad_sync: bool = True
    #: per cut, the bytes of ``cut_fixed`` / ``cut_batch`` held whole (``R``) on the submesh's last (tp)
    #: axis; with ``scatter_gather`` each tp rank sends 1/tp of them and the receiving group all-gathers
    #: them over tp (Megatron-LM's scatter/gather of stage-boundary tensors, on by default there)
    cut_whole_fixed: list = field(default_factory=list)
    cut_whole_batch: list = field(default_factory=list)
    scatter_gather: bool = False
    blocking_sends: bool = False  # sends block the sender's stream too (``scoring.send_seconds``)
    #: with ``scatter_gather``, the pieces are DeepSpeed's ``PartitionedTensor``s: copies around every
    #: gather and send, and the sender gathers its own output again before its backward
    #: (``partitioned_tensors``; ``scoring.regather_seconds``, ``scoring.piece_copy_seconds``)
    deepspeed_gathers: bool = False

    def cut_bytes(self, m: int) -> list[float]:
        return [f + b / m for f, b in zip(self.cut_fixed, self.cut_batch)]

    def cut_whole_bytes(self, m: int) -> list[float]:
        """Per cut, the bytes of ``cut_bytes(m)`` held whole on the tp axis (0 where unknown)."""
        if not self.cut_whole_fixed:
            return [0.0] * len(self.cut_fixed)
        return [f + b / m for f, b in zip(self.cut_whole_fixed, self.cut_whole_batch)]

    def repeat_blocks(self, n: int) -> "SubmeshProfile":
        """The profile of the same model with ``n`` identical blocks: the first traced block stays the
        first (it alone reads what precedes the blocks), the middle traced block stands for the rest."""
        blocks = [i for i, u in enumerate(self.units) if u.block is not None]
        if not blocks:
            raise ValueError("the profile has no numbered blocks to repeat")
        first, last = blocks[0], blocks[-1]
        if blocks != list(range(first, last + 1)) or len({self.units[i].block for i in blocks}) != 1:
            raise ValueError("repeat_blocks needs one contiguous run of identical blocks, got "
                             f"{[self.units[i].name for i in blocks]}")
        rep = blocks[len(blocks) // 2]
        inner = rep if rep < last else rep - 1  # a cut between two blocks (if there are two)
        pre, post = self.units[:first], self.units[last + 1:]
        name = self.units[rep].block
        units = pre + [replace(self.units[rep], name=name.replace("#", str(k))) for k in range(n)] + post
        costs = self.costs[:first] + [self.costs[first]] + [self.costs[rep]] * (n - 1) + self.costs[last + 1:]

        def cuts(values):
            return values[:first] + [values[inner]] * (n - 1) + values[last:]

        return SubmeshProfile(self.mesh, units, costs, cuts(self.cut_fixed), cuts(self.cut_batch), self.solution,
                              self.batch_shard, dict(self.stats, repeated_blocks=n), self.overlap_grad_sync,
                              cuts(self.cut_whole_fixed) if self.cut_whole_fixed else [],
                              cuts(self.cut_whole_batch) if self.cut_whole_batch else [], self.scatter_gather,
                              self.blocking_sends, self.deepspeed_gathers)


def submesh_shapes(group_size: int, hardware: Hardware) -> list[tuple[int, int]]:
    """Logical (dp, tp) shapes of a rank group: tp divides the group and stays within one node
    (tensor parallel on the fast link), unless the group is smaller than a node."""
    limit = max(1, min(group_size, hardware.devices_per_node))
    return [(group_size // tp, tp) for tp in range(1, limit + 1) if group_size % tp == 0 and limit % tp == 0]


def profile_submesh(captured: CapturedGraph, solution: Solution, ctx: Optional[PlanContext] = None, *,
                    units: Optional[list[LayerUnit]] = None) -> SubmeshProfile:
    """Price every layer unit of ``captured`` under ``solution`` (on ``solution.mesh``), on ``ctx``'s
    hardware and optimizer (None: the default context)."""
    ctx = PlanContext.given(ctx)
    hw, optimizer = ctx.spec, ctx.optimizer
    units = units if units is not None else layer_units(captured)
    mesh = solution.mesh
    facts = GraphFacts(captured, hw)
    cm = CostModel(mesh, hw, optimizer)
    batch = batch_dependent(captured)
    # the microbatch count the plan was chosen at (``plan_submesh``): its ops' shapes set their efficiency
    m_ref = int(solution.solver_stats.get("microbatches") or 1)
    microbatch_facts = MicrobatchFacts(captured, hw, m_ref) if m_ref > 1 else facts
    unit_of = {name: i for i, u in enumerate(units) for name in u.nodes}
    acc = [dict.fromkeys(UnitCost.__dataclass_fields__, 0.0) for _ in units]
    strategies = solution.strategies
    foreach = hw.name.lower() != "cpu"  # as ``evaluate``: torch's for-loop optimizer on CPU
    adam = str(optimizer).lower() in ("adam", "adamw")
    for i, unit in enumerate(units):
        for name in unit.nodes:
            s = strategies[name]
            fwd, bwd = facts.compute(name)
            div = cm.work_divisor(s)
            part = "batch" if name in batch else "fixed"
            acc[i][f"fwd_{part}"] += fwd / div
            acc[i][f"bwd_{part}"] += bwd / div
            price = cm.price_node(name, s, facts)
            share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
            overhead = facts.overhead(name)  # paid by every microbatch whatever its size
            acc[i]["fwd_fixed"] += overhead * share
            acc[i]["bwd_fixed"] += overhead * (1 - share)
            # the price beyond the even split of the work (a GEMM shard's tile and wave efficiency, a
            # kernel's floor, a lowering's own work) depends on the shapes: a batch-dependent op's is that
            # of one microbatch of the plan's own count, charged once per microbatch (``*_batch`` m_ref
            # times); the whole batch's was charged once per microbatch before, m times over (issue 27:
            # the MT-NLG head, N = 50272 / 8, 11 ms per microbatch at dp 8 and 8 ms at dp 12 for the same work)
            if part == "batch" and m_ref > 1:
                per_mb = cm.price_node(name, s, microbatch_facts).compute - overhead - (fwd + bwd) / div / m_ref
                excess = per_mb * m_ref
            else:
                excess = price.compute - overhead - (fwd + bwd) / div
            acc[i][f"fwd_{part}"] += excess * share
            acc[i][f"bwd_{part}"] += excess * (1 - share)
            # a lowering's own collectives: an MoE layer's all-to-alls carry its tokens (they follow the
            # batch); batch-norm statistics and a loss's total weight do not
            moved = part if is_moe_node(facts.nodes[name]) else "fixed"
            for c in price.collectives:
                fixed = cm.collective(c.kind, c.axis, 0).seconds
                acc[i][f"{c.phase}_fixed"] += fixed
                acc[i][f"{c.phase}_{moved}"] += c.seconds - fixed
            acc[i][f"act_{part}"] += cm.node_activation_bytes(name, s, facts)
    readers: dict[str, list[int]] = {}
    last_reader: dict[tuple[str, int], int] = {}
    for u, slot, v, _ in graph_edges(captured):
        if v == OUTPUT:
            continue
        readers.setdefault(u, []).append(unit_of[v])
        key = (u, slot)
        last_reader[key] = max(last_reader.get(key, -1), unit_of[v])
    for name, kind in facts.kind.items():
        if kind not in ("param", "buffer") or name not in readers:
            continue
        if kind == "param":
            for i in set(readers[name]):
                acc[i]["param_reads"] += 1
        owner = min(readers[name])  # a tied weight lives with its first reader
        price = cm.price_node(name, strategies[name], facts)
        for key in ("params", "grads", "optimizer"):
            acc[owner][key] += getattr(price, key)
        acc[owner]["held_grads"] += price.held_grads  # zero1: the unreduced gradient, held over the microbatches
        if kind == "param" and price.grads > 0:
            temporaries = optimizer_temporaries([price.params], optimizer, foreach)
            acc[owner]["opt_fixed"] += temporaries if foreach else 0.0
            acc[owner]["opt_peak"] = max(acc[owner]["opt_peak"], 0.0 if foreach else temporaries)
            acc[owner]["opt_fixed"] += STEP_COUNTER_BYTES if adam else 0.0
        if kind == "param" and price.grads > 0:
            zero_step_costs(acc[owner], cm, name, strategies[name], price, facts)
        else:
            acc[owner]["grad_sync"] += sum(c.seconds for c in price.grad_sync)
    out_placements = output_placements(captured, mesh.ndim)
    made: set = set()  # copies made by an earlier reader, shared as ``evaluate`` prices them
    for u, slot, v, k in graph_edges(captured):
        src = strategies[u].outputs[slot]
        dst = (out_placements or src) if v == OUTPUT else strategies[v].inputs[k]
        if tuple(src) == tuple(dst):
            continue
        i = len(units) - 1 if v == OUTPUT else unit_of[v]
        part = "batch" if u in batch else "fixed"
        grad = v != OUTPUT and facts.value_needs_grad(u, slot)  # as ``evaluate`` prices it
        meta = facts.tensor_outputs(u)[slot]
        colls, copy = cm.price_edge(src, dst, meta, grad)
        if v != OUTPUT and k in written_operands(facts.nodes[v]):  # moved back after the op
            colls = colls + cm.price_edge(dst, src, meta, grad)[0]
        elif colls:
            shared = (u, slot, normalize(dst, mesh.shape))
            colls = () if shared in made else colls
            made.add(shared)
        for c in colls:
            fixed = cm.collective(c.kind, c.axis, 0).seconds
            acc[i][f"{c.phase}_fixed"] += fixed
            acc[i][f"{c.phase}_{part}"] += c.seconds - fixed
        acc[i][f"act_{part}"] += copy if v == OUTPUT else cm.edge_activation_bytes(copy, facts, v, k)
    cut_fixed = [0.0] * max(0, len(units) - 1)
    cut_batch = [0.0] * max(0, len(units) - 1)
    whole_fixed, whole_batch = [0.0] * len(cut_fixed), [0.0] * len(cut_batch)
    tp_axis = mesh.ndim - 1
    for (u, slot), last in last_reader.items():
        if u not in unit_of:
            continue  # inputs and parameters reach every stage from the data loader / their owner
        meta = facts.tensor_outputs(u)[slot]
        placement = strategies[u].outputs[slot]
        local = meta.nbytes / cm.shard_factor(placement)
        target = cut_batch if u in batch else cut_fixed
        whole = (whole_batch if u in batch else whole_fixed) if encode(placement)[tp_axis] == R_CODE else None
        for c in range(unit_of[u], last):
            target[c] += local
            if whole is not None:
                whole[c] += local
    costs = [UnitCost(**a) for a in acc]
    return SubmeshProfile(mesh, list(units), costs, cut_fixed, cut_batch, solution, batch_granularity(captured, solution),
                          cut_whole_fixed=whole_fixed, cut_whole_batch=whole_batch)


#: work-seconds each hinted layout's own (pinned, mostly fixed) solve may spend
_HINT_S = 0.5


@dataclass(frozen=True)
class CandidateSpec:
    """How one pipeline candidate's intra-op plan is priced (``plan_submesh``): at ``microbatches``
    microbatches, activations held ``held`` times; the real model has ``repeat`` times the traced blocks
    (their ILP nodes and the edges inside one block count that many times more); ``chain_repeat``: how
    many times more an edge from one traced block to the next counts (default ``repeat``; traced b of n
    blocks: (n - 1) / (b - 1))."""
    microbatches: int
    held: int
    repeat: float = 1.0
    chain_repeat: Optional[float] = None


def plan_submesh(captured: CapturedGraph, mesh: Mesh, ctx: PlanContext, spec: CandidateSpec, *,
                 pins: Optional[Pins] = None, hints: Sequence[Pins] = (), memo: Optional[dict] = None) -> Solution:
    """The intra-op plan for the stages of a pipeline on ``mesh`` (see module docstring), priced as
    ``spec`` says on ``ctx``'s hardware and optimizer, within ``ctx``'s memory limit.
    ``ctx.time_limit_s`` caps the ILP solves together, in deterministic work (at least half a second each).
    The parameters may take ZeRO-1 / ZeRO-2 storage forms (``passes.sharding.storage_forms``; not
    ``once``, which ``held_reductions`` adds to finished plans), priced at ``microbatches`` per step
    (``passes.cost.storage_prices``; ``profile_submesh`` prices the chosen ones per microbatch and step).
    ``pins``: decisions fixed as in ``plan_sharding`` (e.g. to price a rejected layout). ``hints``: pins
    of known plans (a published layout of this submesh's shape): each is priced on the same ILP
    (``solve.hint_plans``) and the solve starts from, and never returns worse than, the best of them.

    When no plan fits the memory limit with activations held ``held`` times, the plan for ONE held
    microbatch (what a recomputing stage keeps), and failing that the least-memory plan (storage
    sharded wherever it can be, e.g. FSDP on the data-parallel axis): the stage ILP then decides
    whether recompute or more stages make it fit. ``solver_stats["status"]`` says which;
    ``solver_stats["work_s"]``: the deterministic seconds its solves spent.

    ``memo``: a dict the caller keeps for calls on the same ``captured``, submesh shape, ``ctx`` (but its
    memory and time limits), ``spec.microbatches`` and ``hints``, without ``pins`` (a candidate planned
    again: re-solved longer, under a leaner budget, re-planned to fit). The problem is built once,
    each strategy graph priced once per held count (limited anew per memory limit), and each hint solved once per graph and
    work limit (its work charged again as if solved): the answer is the one a fresh call gives."""
    hardware, optimizer, memory_limit, time_limit_s = ctx.spec, ctx.optimizer, ctx.memory_bytes, ctx.time_limit_s
    microbatches, held, repeat, chain_repeat = spec.microbatches, spec.held, spec.repeat, spec.chain_repeat
    left = [float(time_limit_s)]  # deterministic seconds still to spend: never the clock

    def budget(floor: float) -> float:
        return max(floor, left[0])

    def spend(result) -> None:
        left[0] -= float(result.stats.get("work", 0.0))

    def divisible_at_microbatch(table, mesh, allowed):
        for name, keep in microbatch_strategies(captured, table, mesh, microbatches).items():
            both = set(allowed.get(name, keep)) & keep
            if not both:
                raise PinError(f"the pins on {name!r} split its batch dimension more ways than a microbatch of "
                               f"1/{microbatches} of the batch has rows; pin fewer ways or use fewer microbatches")
            allowed[name] = both
        return free_forms(captured, table, allowed, microbatches)

    memo = memo if memo is not None and pins is None else {}
    problem = memo.get("problem")
    if problem is None:
        problem = memo["problem"] = build_problem(
            captured, mesh, hardware=hardware, pins=pins, facts=MicrobatchFacts(captured, hardware, microbatches),
            narrow=divisible_at_microbatch, choices=strategy_choices(captured, mesh, pins, storage_forms=True))
    mesh = problem.mesh
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    graph, result, status = None, None, None
    for k in dict.fromkeys((held, 1)):
        key = (k, memory_limit, repeat, chain_repeat)
        if ("graph",) + key in memo:
            graph = memo[("graph",) + key]
        else:
            # the prices do not read the memory limit: a candidate planned again under another budget (the
            # re-plans that fit its stages, the leaner finalist) reuses them, its graph only limited anew
            priced = memo.get(("priced", k, repeat, chain_repeat))
            if priced is None:
                # every parameter's optimizer step (1/m of it) and gradient accumulations ((m-1)/m of one) per
                # microbatch, as the stage scorer charges the profile's ``opt_step`` and ``accumulate`` per step:
                # without them the ILP chose weights replicated over tp whose 8x larger updates and accumulations
                # the stages then paid (Llama 3 405B, pp 16, (128, 8): 1.2 s per microbatch the ILP never saw)
                cm = MicrobatchCostModel(mesh, hardware, optimizer, microbatches, k)
                # the held count changes what nodes keep, not what edges cost: the second graph reuses the first's edges
                priced = problem.strategy_graph(cm, memory_limit, edges_from=graph)
                if repeat != 1.0:
                    _repeat(priced, problem.clustering, nodes, captured, repeat,
                            repeat if chain_repeat is None else chain_repeat)
                memo[("priced", k, repeat, chain_repeat)] = priced
            graph = memo[("graph",) + key] = replace(priced, memory_limit=memory_limit)
        hinted = []
        if hints:
            hint_s = min(_HINT_S, budget(0.1))
            if ("hinted", hint_s) + key not in memo:
                memo[("hinted", hint_s) + key] = pinned_choices(problem, graph, hints, time_limit_s=hint_s)
            hinted, work = memo[("hinted", hint_s) + key]
            left[0] -= work
        result = solve(graph, time_limit_s=budget(0.5), hints=hinted)
        spend(result)
        if result.choice is not None:
            status = result.status if k == held else f"{result.status}_HELD_1"
            break
    if result.choice is None:
        result = solve(graph, objective="memory", time_limit_s=budget(1.0))
        spend(result)
        status = "MEMORY_FALLBACK"
    if result.choice is None:
        raise InfeasiblePlanError(f"the intra-op solver found no plan at all on submesh {mesh.shape} within "
                                  f"{time_limit_s} s ({result.status}); raise time_limit_s")
    stats = {"status": status, "solve_s": round(result.wall_s, 4), "objective": result.cost, "microbatches": microbatches,
             "held": held, "memory_limit": memory_limit, "work_s": round(float(time_limit_s) - left[0], 4)}
    return problem.solution(result.choice, optimizer=optimizer, solver_stats=stats)


def _repeat(graph, clustering, nodes: dict, captured: CapturedGraph, repeat: float, chain: float) -> None:
    """Count every ILP node inside a numbered block ``repeat`` times more, and every edge as the deep
    model has it: inside one block instance ``repeat`` times, from one instance to another ``chain``
    times, once elsewhere (an ILP edge sums the graph edges between its two clusters)."""
    instance = {name: block_instance(module_path(node, captured)) for name, node in nodes.items()}
    inside = {i for i, sg in enumerate(graph.nodes) if instance.get(sg.name) is not None}
    for i in inside:
        graph.nodes[i].multiplicity = max(1, round(graph.nodes[i].multiplicity * repeat))
    weight: dict = {}
    for u, slot, v, k in graph_edges(captured):
        key = (clustering.cluster_of[u], slot, OUTPUT if v == OUTPUT else clustering.cluster_of[v], k)
        a, b = instance.get(u), None if v == OUTPUT else instance.get(v)
        w = 1.0 if a is None or b is None else repeat if a == b else chain
        weight[key] = weight.get(key, 0.0) + w
    keys = list(cluster_edges(graph_edges(captured), clustering))
    if len(keys) != len(graph.edges):
        raise AssertionError(f"{len(graph.edges)} ILP edges but {len(keys)} cluster edges: the strategy graph and "
                             "the clustering disagree")
    for e, key in zip(graph.edges, keys):
        e.multiplicity = max(1, round(weight[key]))
