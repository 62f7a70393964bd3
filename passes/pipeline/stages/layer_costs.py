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

from autoshard.passes.solve.clustering import (OUTPUT, block_instance, graph_edges, module_path,
                                               output_placements)
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel, gradient_precision
from autoshard.passes.cost.moe import is_moe_node
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.peak_timeline import optimizer_temporaries
from autoshard.passes.solve.step_trace import STEP_COUNTER_BYTES
from autoshard.passes.solve.solution import Solution
from autoshard.passes.layout.shapes import normalize
from autoshard.passes.layout.redistribution import R_CODE, encode
from autoshard.passes.pipeline.stages.stage_zero import zero_step_costs
from autoshard.passes.writes import written_operands
from autoshard.passes.pipeline.stages.op_cuts import op_graph_units
from autoshard.passes.solve.microbatch import MicrobatchFacts, batch_dependent, batch_granularity

__all__ = ["LayerUnit", "UnitCost", "SubmeshProfile", "layer_units", "batch_dependent", "profile_submesh",
           "submesh_shapes"]


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
    adds in flight is counted from ``grads``, as for the other forms). ``made_grads``: those bytes of
    ``grads`` as one backward makes them, in the compute dtype, before they are added into the held
    ones (they differ where gradients are held in the reduce dtype, ``CostModel.grad_dtype``; None:
    ``grads``): ``in_flight_grads``."""
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
    made_grads: Optional[float] = None

    @property
    def in_flight_grads(self) -> float:
        """Bytes of the gradients one backward of the unit makes (``made_grads``, else ``grads``)."""
        return self.grads if self.made_grads is None else self.made_grads

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
    cm = CostModel(mesh, hw, optimizer, **gradient_precision(solution.levers.mixed_precision))
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
        made = price.grads
        if kind == "param" and cm.accumulate_in_reduce_dtype:  # held in the reduce dtype, made in the compute one
            meta = facts.tensor_outputs(name)[0]
            made = price.grads * meta.dtype.itemsize / cm.grad_dtype(meta).itemsize
        acc[owner]["made_grads"] += made
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
