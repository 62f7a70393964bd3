"""What a block type's memory-lever policy does to the price of its nodes and edges.

The policies a repeated-block type may take, in the planner's order (fastest first):

    KEEP       no recomputation, gathered parameter copies kept to the backward
    RESHARD    no recomputation, gathered parameter copies freed after the forward and gathered
               again for the backward (ZeRO-3)
    SELECTIVE  keep the outputs of matmul and attention kernels (and what leaves the block),
               recompute everything else before the block's backward; recomputation gathers again
    FULL       keep only what leaves the block, re-run the whole block before its backward
    SELECTIVE_OP  torchtitan's op-level policy (``passes.capture.saved.op_policy_saves``): keep the
               attention kernels' outputs and every other ``aten.mm`` output of each block run (the
               runtime's checkpoint region: consecutive nodes of one instance), recompute the rest,
               the other matmuls included. Chosen only when pinned (``passes.levers.PINNED_ONLY_CHECKPOINTS``).

Prices per node and edge of a block instance (``LeverPrice``), with the saved-tensor analysis
(``passes.capture.saved``) and the block structure (``passes.solve.blocks``):

- time: the op's own price, plus under SELECTIVE (ops that are not matmul / attention kernels),
  SELECTIVE_OP (ops none of whose kernels that policy saves: ``LeverPricer.op_level_recomputed``) and
  FULL its forward again (work and one launch); an edge into a recomputing block pays its forward
  collectives again (re-issued by the recomputation), and under RESHARD an edge from a parameter
  its gather again;
- kept bytes (alive at the end of the forward): KEEP and RESHARD keep what autograd saves, except
  that RESHARD keeps no gathered parameter; SELECTIVE keeps the kernel outputs and the values that
  leave the instance; FULL the values that leave it. A value made outside blocks and read by a
  checkpointed block is held by the checkpoint even if nothing saves it;
- transient bytes, counted for one instance of a type (each instance carries ``1 / n`` of it):
  what a recomputing instance re-creates for its backward (the bytes KEEP would keep beyond what
  the policy keeps), and the gathered parameter copies of two instances (the prefetch of the next
  block's gathers overlaps this block's use) when gathered copies are not kept.

A parameter copy is one the runtime's gatherer makes: one that communicates, or under mixed
precision the cast copy even where no collective is needed; either is priced as gathered.

Nodes outside numbered blocks, parameters and inputs have no policy (``policy=None``): they are
priced as KEEP. Gradient accumulation (``k`` microsteps) and mixed precision enter through the cost
model and graph facts handed in (``passes.solve.microbatch``; ``CostModel.reduce_dtype``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autoshard.passes.capture.saved import OP_POLICY_COUNTED, op_policy_saves
from autoshard.passes.cost.collectives import Collective
from autoshard.passes.cost.moe import is_moe_node, work_factor
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel, NodePrice
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.levers import BlockPolicy, block_levers, block_policies, lever_rows
from autoshard.passes.solve.blocks import BlockMap, storage_owner
from autoshard.passes.solve.clustering import OUTPUT, graph_edges
from autoshard.passes.spec import Strategy, TensorMeta
from autoshard.passes.writes import written_operands

__all__ = ["POLICIES", "KEEP", "RESHARD", "SELECTIVE", "FULL", "LeverPrice", "LeverPricer", "policy_index",
           "policy_space"]

#: the block policy space of the built-in table, generated from its per-block rows; readers index the
#: live space (``policy_space()``), which is this one unless a row was added (a test's)
POLICIES: tuple[BlockPolicy, ...] = block_policies()
#: every lever at its default: the first policy of any space (each row's choices start at its default)
KEEP = 0
RESHARD, SELECTIVE, FULL = (POLICIES.index(p) for p in (
    BlockPolicy(reshard_after_forward=True), BlockPolicy(checkpoint="selective", reshard_after_forward=True),
    BlockPolicy(checkpoint="full", reshard_after_forward=True)))
# how this module prices a policy (the checkpoint and reshard_after_forward levers' price): keeps what
# autograd saves, frees gathered copies after the forward, or recomputes
_KEEPS, _RESHARDS, _RECOMPUTES = range(3)
_space_cache: dict = {}


def policy_space() -> tuple[BlockPolicy, ...]:
    """The block policy space of the lever table as it stands (``passes.levers.block_policies``)."""
    rows = lever_rows()
    if _space_cache.get("rows") is not rows:
        _space_cache.update(rows=rows, space=block_policies())
    return _space_cache["space"]


def _kind(policy: BlockPolicy) -> int:
    if policy.checkpoint != "none":
        return _RECOMPUTES
    return _RESHARDS if policy.reshard_after_forward else _KEEPS


def _price_hooks(policy: BlockPolicy) -> tuple:
    """(row, value) of each lever pulled in ``policy`` whose row prices it (``Lever.price``)."""
    return tuple((row, getattr(policy, row.keyword)) for row in block_levers()
                 if row.price is not None and getattr(policy, row.keyword) != row.default)


def policy_index(policy: BlockPolicy) -> int:
    """The index in ``policy_space()`` of a ``BlockPolicy``, with the values its levers force filled in (a
    recomputing one re-gathers either way)."""
    forced = {}
    for row in block_levers():
        value = row.forced_by({r.keyword: getattr(policy, r.keyword) for r in block_levers() if r is not row}) \
            if row.forced_by is not None else None
        if value is not None:
            forced[row.keyword] = value
    return policy_space().index(policy.replace(**forced) if forced else policy)


@dataclass
class LeverPrice:
    """Seconds and bytes per device of one node or edge under one policy (bytes by category)."""
    seconds: float = 0.0
    kept: float = 0.0  # activations alive at the end of the forward
    gathered: float = 0.0  # gathered parameter copies alive at the end of the forward
    recompute: float = 0.0  # this item's share of one instance's recomputed activations
    gathered_transient: float = 0.0  # its share of the gathered copies alive at once when not kept
    gather_copy: float = 0.0  # a parameter edge: the bytes of the gathered copy, kept or not

    @property
    def memory(self) -> float:
        return self.kept + self.gathered + self.recompute + self.gathered_transient


class LeverPricer:
    """Prices nodes and edges of one program under the memory-lever policies (module docstring)."""

    def __init__(self, captured: CapturedGraph, facts: GraphFacts, cm: CostModel, blocks: BlockMap):
        self.captured, self.facts, self.cm, self.blocks = captured, facts, cm, blocks
        self._space = space = policy_space()
        self._kinds = tuple(_kind(p) for p in space)  # index -> how checkpoint/reshard price it
        self._hooks = tuple(_price_hooks(p) for p in space)  # index -> the other levers' price hooks
        self._move_sums: dict = {}
        self._op_level: Optional[dict[str, float]] = None
        self._block_reads: dict[tuple[str, int], int] = {}  # outside value -> edges reading it in blocks
        #: ``clustering.graph_edges(captured)``, listed once (walking every node's operands was a third of
        #: pricing an assignment, ``solution.evaluate``, which read them three times)
        self.edges = graph_edges(captured)
        for u, slot, v, _ in self.edges:
            if v != OUTPUT and u not in blocks.instance and v in blocks.instance and facts.kind[u] == "op":
                self._block_reads[(u, slot)] = self._block_reads.get((u, slot), 0) + 1

    # ---- nodes ---------------------------------------------------------------------------------
    def node(self, name: str, strategy: Strategy, policy: Optional[int],
             freed: tuple[int, ...] = (), base: Optional[NodePrice] = None) -> tuple[NodePrice, LeverPrice]:
        """The node's cost-model price (parameter state, gradient syncs, its KEEP activations) and
        its price under ``policy`` (None: no policy applies). ``freed``: output slots no one keeps
        in the node's own placement (``freed_outputs``), left out of what it keeps. ``base``: the
        cost-model price of this node and strategy when the caller already has it (it does not
        depend on the policy), else worked out here."""
        if base is None:
            base = self.cm.price_node(name, strategy, self.facts)
        kept = base.activations - self._slot_bytes(name, strategy, freed, saved_only=True)
        price = LeverPrice(seconds=base.seconds, kept=kept)
        if policy is None or self.facts.kind[name] != "op":
            return base, price
        self._recompute(name, strategy, policy, freed, base, kept, price)
        for row, value in self._hooks[policy]:
            row.price(value, price, self.cm.hardware)
        return base, price

    def _recompute(self, name: str, strategy: Strategy, policy: int, freed: tuple, base: NodePrice, kept: float,
                   price: LeverPrice) -> None:
        """``price`` of an op under a recomputing policy: what it keeps, re-creates and runs again."""
        if self._kinds[policy] != _RECOMPUTES:
            return
        n = self.blocks.num_instances(self.blocks.type_of(name))
        slots = tuple(s for s in self.blocks.leaving.get(name, ()) if s not in freed)
        leave = self._slot_bytes(name, strategy, slots)
        selective = self._selective_bytes(name, strategy) if self._space[policy].checkpoint == "selective" else 0.0
        if self._space[policy].checkpoint == "selective_op":
            selective = self._selective_bytes(name, strategy) * self.op_level_kept_fraction().get(name, 0.0)
            if name in self.op_level_skipped():  # never re-run: re-creates nothing, costs nothing again
                price.kept = max(selective, leave)
                return
        price.kept = max(selective, leave)
        price.recompute = max(0.0, kept - price.kept) / n
        if self._space[policy].checkpoint == "full" or selective == 0.0:
            fwd, _ = self.facts.compute(name)
            launch = self.cm.hardware.op_overhead_s if self.facts.launches(name) else 0.0
            again = fwd / self.cm.work_divisor(strategy)
            node = self.facts.nodes[name]
            if is_moe_node(node):  # its forward again: the busiest rank's share
                again = again * work_factor(node, strategy, self.cm.mesh.shape)
            if base.collectives:  # a lowering's own forward collectives run again (an MoE layer's all-to-alls)
                again = again + sum(c.seconds for c in base.collectives if c.phase == "fwd")
            price.seconds += again + launch

    def op_level_kept_fraction(self) -> dict[str, float]:
        """Node -> the fraction of its matmul / attention kernel output bytes (``selective_bytes``) that
        the op-level policy keeps (absent: none; such a node is recomputed unless ``op_level_skipped``).
        The ``aten.mm`` count runs over each block run in graph order: the consecutive ops of one
        instance, which the runtime checkpoints as one region (``runtime.regions``)."""
        if self._op_level is None:
            self._op_level, self._op_skipped = {}, set()
            for run in self._block_runs():
                count = 0
                for name in run:
                    info = self.facts.saved_of(name)
                    kept = 0
                    for op, nbytes in (info.kernel_outputs if info is not None else ()):
                        count += op == OP_POLICY_COUNTED
                        kept += nbytes if op_policy_saves(op, count) else 0
                    if kept and info.selective_bytes:
                        self._op_level[name] = kept / info.selective_bytes
                self._op_skipped.update(_after_last_pack(run, self.facts.saved_of))
        return self._op_level

    def op_level_skipped(self) -> set[str]:
        """Block ops the op-level policy's recomputation never reaches: torch's non-reentrant checkpoint
        stops re-running a region once its last saved tensor is packed again (``early_stop``, on by
        default; torch/utils/checkpoint.py ``_StopRecomputationError``), and an op packs its operands
        before its kernel runs, its outputs after. So the ops after the region's last packing op, and
        that op too when it packs only operands (a block's last linear), are not re-run."""
        self.op_level_kept_fraction()
        return self._op_skipped

    def _block_runs(self) -> list[list[str]]:
        """Runs of consecutive ops of one block instance, in graph order."""
        runs, current = [], None
        for node in self.captured.gm.graph.nodes:
            if node.op != "call_function":
                continue  # as the runtime's regions, which hold ops only
            instance = self.blocks.instance.get(node.name)
            if instance != current:
                current = instance
                if instance is not None:
                    runs.append([])
            if instance is not None:
                runs[-1].append(node.name)
        return runs

    def op_level_recomputed(self, names) -> list[str]:
        """The ops of ``names`` in numbered blocks that the op-level policy recomputes (re-runs)."""
        kept, skipped = self.op_level_kept_fraction(), self.op_level_skipped()
        return [n for n in names if n in self.blocks.instance and self.facts.kind.get(n) == "op" and n not in kept
                and n not in skipped]

    def freed_outputs(self, strategies: dict[str, Strategy], policy_of) -> dict[str, tuple[int, ...]]:
        """Op outputs whose every holder for the backward reads a redistributed copy: the copy is
        kept (priced on the edge) and the original freed after its forward uses, unless the op's
        own backward saves it. A holder is a reader that saves the operand (no recomputing policy)
        or a recomputing block instance other than the producer's (its checkpoint holds its
        inputs). ``policy_of(name)``: a node's policy index or None. Used when pricing a whole
        assignment (``solution.evaluate``); the ILP prices nodes and edges apart and so keeps both
        (an over-estimate by these bytes)."""
        holders: dict[tuple[str, int], set[bool]] = {}
        facts, inst = self.facts, self.blocks.instance
        for u, slot, v, i in self.edges:
            if facts.kind.get(u) != "op":
                continue
            if v == OUTPUT:
                holders.setdefault((u, slot), set()).add(True)
                continue
            policy = policy_of(v)
            holds = (facts.operand_saved(v, i) if policy is None or self._kinds[policy] != _RECOMPUTES
                     else inst.get(v) != inst.get(u))
            if holds:
                same = tuple(strategies[u].outputs[slot]) == tuple(strategies[v].inputs[i])
                holders.setdefault((u, slot), set()).add(same)
        freed: dict[str, list[int]] = {}
        for (u, slot), kinds in holders.items():
            info = facts.saved_of(u)
            if kinds == {False} and info is not None and slot not in info.self_saved_outputs:
                freed.setdefault(u, []).append(slot)
        return {u: tuple(sorted(s)) for u, s in freed.items()}

    def _slot_bytes(self, name: str, strategy: Strategy, slots, saved_only: bool = False) -> float:
        """Local activation bytes of the node's output ``slots`` (of its saved ones: ``saved_only``)."""
        if not slots:
            return 0.0
        if saved_only:
            info = self.facts.saved_of(name)
            slots = [s for s in slots if info is not None and s in info.saved_outputs]
        metas = self.facts.tensor_outputs(name)
        return self.cm.activation_bytes([metas[s] for s in slots], [strategy.outputs[s] for s in slots])

    def _selective_bytes(self, name: str, strategy: Strategy) -> float:
        """Local bytes of the node's matmul / attention kernel outputs (split like its output)."""
        total = self.facts.selective_bytes(name)
        if not total:
            return 0.0
        div = self.cm.shard_factor(strategy.outputs[0]) if strategy.outputs else self.cm.work_divisor(strategy)
        return self.cm.kept(total / div)

    # ---- edges ---------------------------------------------------------------------------------
    def edge(self, u: str, slot: int, v: str, index: int, src: tuple, dst: tuple,
             policy: Optional[int]) -> tuple[tuple[Collective, ...], LeverPrice]:
        """Operand ``index`` of ``v`` (or the program's output) read from output ``slot`` of ``u``,
        moved from placement codes ``src`` to ``dst``, with ``v``'s block type under ``policy``:
        the collectives (forward, then backward) and the price."""
        reading = self._reading(u, slot, v, index)
        colls, copy, forward, total = self._move(reading, src, dst)
        price = LeverPrice(*self._price(reading, forward, total, copy, src, policy))
        for row, value in self._hooks[policy] if policy is not None else ():
            row.price(value, price, self.cm.hardware)
        price.gather_copy = copy if _is_param_copy(reading, forward) else 0.0
        return colls, price

    def edge_table(self, u: str, slot: int, v: str, index: int, srcs: list, dsts: list,
                   policies: list) -> list[list[list[tuple[float, float]]]]:
        """(seconds, bytes) of ``edge`` for every policy, consumer placement and producer placement:
        ``[policy][dst][src]`` (the invariants of the edge worked out once)."""
        reading = self._reading(u, slot, v, index)
        table = [[[None] * len(srcs) for _ in dsts] for _ in policies]
        for q, dst in enumerate(dsts):
            for p, src in enumerate(srcs):
                _, copy, forward, total = self._move(reading, src, dst)
                for b, policy in enumerate(policies):
                    seconds, *memory = self._price(reading, forward, total, copy, src, policy)
                    if policy is not None and self._hooks[policy]:
                        hooked = LeverPrice(seconds, *memory)
                        for row, value in self._hooks[policy]:
                            row.price(value, hooked, self.cm.hardware)
                        seconds, memory = hooked.seconds, [hooked.memory]
                    table[b][q][p] = (seconds, sum(memory))
        return table

    def _reading(self, u: str, slot: int, v: str, index: int) -> tuple:
        """What pricing one operand read needs beyond its placements, worked out once."""
        facts = self.facts
        meta = facts.tensor_outputs(u)[slot]
        is_param = facts.kind[u] == "param"
        grad = v != OUTPUT and facts.value_needs_grad(u, slot)  # an output's gradient seed is free
        cast = is_param and facts.master_dtype(u) is not None
        saves = v == OUTPUT or facts.operand_saved(v, index)
        n = self.blocks.num_instances(self.blocks.type_of(v)) if v != OUTPUT else 0
        grad_scale = self.cm.reduce_scale(meta) if is_param else 1.0
        written = v != OUTPUT and index in written_operands(facts.nodes[v])
        return u, slot, meta.nbytes, is_param, grad, cast, saves, n, grad_scale, written

    def _move(self, reading: tuple, src: tuple, dst: tuple) -> tuple[tuple[Collective, ...], float, float, float]:
        """(collectives, copy bytes, forward seconds, all seconds) of one move. An operand its reader
        writes in place (``passes.writes``) and that was moved is moved back to ``src`` after the op
        (the runtime's write-back): those collectives are the move's too."""
        _, _, nbytes, _, grad, cast, _, _, grad_scale, written = reading
        key = (src, dst, nbytes, grad, grad_scale, cast, written)
        hit = self._move_sums.get(key)
        if hit is None:
            colls, copy = self.cm.moves(src, dst, nbytes, grad, grad_scale=grad_scale, cast=cast)
            if written and src != dst:
                colls = colls + self.cm.moves(dst, src, nbytes, grad)[0]
            hit = self._move_sums[key] = (colls, copy, sum(c.seconds for c in colls if c.phase == "fwd"),
                                          sum(c.seconds for c in colls))
        return hit

    def _price(self, reading: tuple, forward: float, total: float, copy: float, src: tuple,
               policy: Optional[int]) -> tuple[float, float, float, float, float]:
        """(seconds, kept, gathered, recompute, gathered_transient): ``LeverPrice``'s fields."""
        u, slot, _, is_param, _, cast, saves, n, _, _ = reading
        gathered = is_param and (forward > 0.0 or cast)  # _is_param_copy, inline: the ILP's innermost loop
        kind = _KEEPS if policy is None else self._kinds[policy]
        if kind == _KEEPS:
            if not saves:
                return total, 0.0, 0.0, 0.0, 0.0
            return (total, 0.0, copy, 0.0, 0.0) if gathered else (total, copy, 0.0, 0.0, 0.0)
        seconds = total + (forward if kind != _RESHARDS or is_param else 0.0)  # re-issued, or gathered again
        if gathered:
            return seconds, 0.0, 0.0, 0.0, copy * min(2, n) / n
        if kind == _RESHARDS:
            return seconds, copy if saves else 0.0, 0.0, 0.0, 0.0
        return seconds, self._held_by_checkpoint(u, slot, src), 0.0, (copy if saves else 0.0) / n, 0.0

    def _held_by_checkpoint(self, u: str, slot: int, src: tuple) -> float:
        """A value made outside blocks that a checkpointed block reads is held by the checkpoint:
        its bytes (shared among the edges reading it in blocks) unless autograd keeps it anyway."""
        reads = self._block_reads.get((u, slot))
        if not reads:
            return 0.0
        owner, owner_slot = storage_owner(self.facts, u, slot)
        info = self.facts.saved_of(owner)
        if self.facts.kind.get(owner) != "op" or info is None or owner_slot in info.saved_outputs:
            return 0.0
        meta: TensorMeta = self.facts.tensor_outputs(u)[slot]
        return self.cm.kept(self.cm.local_bytes(meta.nbytes, src)) / reads


def _after_last_pack(run: list[str], saved_of) -> list[str]:
    """The ops of ``run`` a non-reentrant recomputation stops before (``LeverPricer.op_level_skipped``)."""
    for i in range(len(run) - 1, -1, -1):
        info = saved_of(run[i])
        if info is None:
            return []  # unknown packs: assume everything re-runs
        after = bool(info.self_saved_outputs) or info.internal_bytes > 0
        before = bool(info.saved_operands) and info.alias_of is None  # a view's operand is packed by its user
        if after:
            return run[i + 1:]
        if before:
            return run[i:]
    return list(run)


def _is_param_copy(reading: tuple, forward: float) -> bool:
    """Whether a parameter read makes a copy the runtime's ``ParamGatherer`` makes and holds
    (``runtime.lower.plan_copies``): one that communicates, or, under mixed precision, the cast
    compute copy even where the placement needs no collective. Either is priced as a gathered copy
    (kept, or freed and made again under reshard-after-forward), never as an activation."""
    is_param, cast = reading[3], reading[5]
    return is_param and (forward > 0.0 or cast)
