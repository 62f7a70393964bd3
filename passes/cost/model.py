"""Pricing: what one strategy costs per node and per resharding edge, in seconds and bytes per rank.

``CostModel(mesh, hardware)`` prices strategies with the facts ``GraphFacts`` gathered
(``passes/cost/facts.py``: node kinds, gradients, each op's work on one device) and the collective
formulas of ``passes/cost/collectives.py``. A strategy's local compute is the global work divided
by the product of the sizes of the axes on which any operand or output is S or P; launch overhead
(``GraphFacts.overhead``) is not divided. Each collective call adds one op launch, and each
gradient one more when it is copied into its all-reduce bucket. A GEMM's share is corrected for its
shard's own shape (``gemm_shard_factor``: tile and wave efficiency of the local M, N, K) on hardware
with the achievable-compute model (``passes/cost/kernels.py``). Hardware with
``collective_model="nccl"`` (the GPU presets) prices every collective with NCCL's own tuner model
(``passes/cost/nccl.py``: ring / tree / NVLS x Simple / LL128 / LL, the cheapest per call), not the
link formulas; a measured fit in the profile still replaces either.

Redistribution of a tensor from placements ``src`` to ``dst`` runs the runtime's own steps
(``redistribution_steps`` in ``passes/layout/redistribution.py``, which the runtime executes):
unshard from the last axis to the first (S->R all-gather, P->R all-reduce, S(i)->S(j) all-to-all
where nesting allows, else all-gather then chunk), then shard from the first axis to the last
(R->S(d) and R->P local and free, P->S(d) reduce-scatter). The bytes of the collective on axis
``a`` are the tensor's bytes divided by the shard factor of the OTHER axes at that point. Steps
that are all-gathers of one dim over several axes (``passes.layout.gathers.fused_gather``: FSDP's
``(S(0), S(0)) -> (R, R)``) are ONE all-gather over those axes flattened (``Collective.axis`` a
tuple), priced over that group's placement (``Hardware.group_locality``), because that is what the
runtime runs (``runtime.lower``'s moves, ``runtime.param_gather``'s fused copies). Backward
pays each forward collective's adjoint (all-gather <-> reduce-scatter, all-reduce <-> all-reduce,
all-to-all <-> all-to-all; chunk <-> free) unless the value needs no gradient. The program's outputs
are priced as moved to where the runtime leaves them (``passes.solve.clustering.output_placements``:
a loss ``P`` on every axis, anything else ``R``), forward only (the backward seed, ones for a loss,
is available in any placement for free). The callers (``passes.solve``) price a copy several
readers share once and an operand written in place moved back (``passes.writes``).

Memory per rank: parameters, gradients (same dtype) and optimizer state (``optimizer``: "adamw"
keeps 2 fp32 states per element, "sgd_momentum" 1, "sgd" (no momentum) none) divided by the storage
shard factor (a forward-only
program, with no loss, has neither gradients nor optimizer state, and no backward pass); activations are
what autograd keeps for the backward (``passes.capture.saved``): the local bytes of every op output
some op saves, of the tensors an op creates inside itself and saves (split like its work), and of
each redistributed copy whose consumer saves it (e.g. an all-gathered FSDP weight a matmul keeps).
Without that analysis (a program the meta device cannot run): every non-view op output and every
redistributed copy.

Placements travel as integer codes (``encode``, ``passes/layout/redistribution.py``): ``S(d)`` -> d,
``R`` -> ``R_CODE``, ``P`` -> ``P_CODE``.

>>> from autoshard.passes.spec import P, R, S
>>> encode((S(0), R, P))
(0, -1, -2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from autoshard.passes.cost.collectives import Collective, collective_terms, hierarchical_terms, p2p_seconds
from autoshard.passes.cost.facts import GraphFacts, local_gemm_dims
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.kernel_classes import class_seconds
from autoshard.passes.cost.kernels import achievable, gemm_efficiency
from autoshard.passes.cost.optimizer_step import accumulation_bytes, optimizer_step_bytes
from autoshard.passes.cost.nccl import nccl_p2p_seconds, nccl_terms
from autoshard.passes.cost.lowerings import named_lowerings
from autoshard.passes.cost.moe import is_moe_node, work_factor
from autoshard.passes.cost.runtime_host import step_host_seconds
from autoshard.passes.cost.storage_prices import storage_price
from autoshard.passes.layout.gathers import fused_gather
from autoshard.passes.layout.redistribution import R_CODE, encode, placement_code, redistribution_steps
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Strategy, TensorMeta

__all__ = ["optimizer_state_bytes", "CostModel", "NodePrice", "ADJOINT", "encode", "placement_code"]

ADJOINT = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
           "all_reduce": "all_reduce", "all_to_all": "all_to_all"}

_OPTIMIZERS = {"adamw": 8.0, "adam": 8.0, "sgd": 0.0, "sgd_momentum": 4.0, "momentum": 4.0,
               "adafactor": 0.0, "none": 0.0,
               # Megatron-LM's mixed-precision Adam on a 16-bit model: fp32 main parameters and two fp32
               # moments per element (megatron/optimizer/optimizer.py, Float16OptimizerWithFloat16Params)
               "megatron_adam": 12.0}

def optimizer_state_bytes(optimizer: Union[str, float, int]) -> float:
    """Optimizer state bytes per parameter element: a name ("adamw", "sgd", ...) or a number."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer state bytes per element must be >= 0, got {optimizer}")
        return float(optimizer)
    key = str(optimizer).lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {sorted(_OPTIMIZERS)} or the number of "
                         "state bytes per parameter element (AdamW in fp32: 8)")
    return _OPTIMIZERS[key]


@dataclass
class NodePrice:
    """What one node costs under one strategy: local compute seconds, gradient all-reduces (for a
    parameter), and bytes per rank by category."""
    compute: float = 0.0
    grad_sync: tuple = ()
    collectives: tuple = ()  # what the op's own lowering communicates (an MoE layer's all-to-alls)
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    # a parameter's storage form (``passes.cost.storage_prices``): unreduced gradients held over the
    # microsteps (bytes)
    held_grads: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute + sum(c.seconds for c in self.grad_sync) + sum(c.seconds for c in self.collectives)

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.held_grads


class CostModel:
    """Prices strategies and redistributions for one mesh and hardware (caches per instance)."""

    def __init__(self, mesh: Mesh, hardware: Hardware, optimizer: Union[str, float] = "adamw", *,
                 grad_bucket_bytes: float = 25 * 2 ** 20, hierarchical: bool = True, reduce_dtype=None,
                 move_cache: Optional[dict] = None, price_step: bool = True):
        self.mesh = mesh
        self.hardware = hardware
        self.reduce_dtype = reduce_dtype
        self.grad_bucket_bytes = grad_bucket_bytes
        self.hierarchical = hierarchical
        self.opt_bytes = optimizer_state_bytes(optimizer)
        self.optimizer = optimizer
        #: a parameter's price includes its optimizer step (``param_step_seconds``); False for the stage
        #: planner's candidates, whose stage scorer adds it per rank group (``UnitCost.opt_step``)
        self.price_step = price_step
        self.links = [hardware.axis_link(mesh, a) for a in range(mesh.ndim)]
        self._terms = [self._axis_terms(a) for a in range(mesh.ndim)]
        self._flat_terms: dict[tuple[int, ...], dict] = {}  # several axes flattened -> their terms
        # (collectives, copy) per move; cost models of one mesh, hardware and collective settings may
        # share it (``move_cache``): a move's price does not depend on anything else
        self._reshard_cache: dict = {} if move_cache is None else move_cache

    def _axis_terms(self, axis) -> dict[str, list[tuple[float, float]]]:
        """kind -> candidate (fixed seconds incl. launch, seconds per byte); a call costs the cheapest.
        ``axis``: one mesh axis, or a tuple of axes flattened into one group (``Hardware.group_locality``)."""
        hw = self.hardware
        if isinstance(axis, int):
            n, (g, m), link = self.mesh.shape[axis], hw.axis_locality(self.mesh, axis), self.links[axis]
        else:
            n, (g, m) = math.prod(self.mesh.shape[a] for a in axis), hw.group_locality(self.mesh, axis)
            link = ((hw.intra_node_bandwidth, hw.intra_node_latency) if m == 1
                    else (hw.inter_node_bandwidth, hw.inter_node_latency))
        algos = ("ring", "tree") if hw.collective_algorithm == "auto" else (hw.collective_algorithm,)
        intra = (hw.intra_node_bandwidth, hw.intra_node_latency)
        inter = (hw.inter_node_bandwidth, hw.inter_node_latency)
        terms: dict[str, list[tuple[float, float]]] = {}
        for kind in ADJOINT:
            fit = hw.collective_fit(kind, n) if m == 1 else None
            if n <= 1:
                cands = [(0.0, 0.0)]
            elif fit is not None:
                cands = [fit]  # measured: launch and latency are inside the fitted intercept
            elif hw.collective_model == "nccl":
                terms[kind] = nccl_terms(kind, g, m, hw)  # NCCL's base latencies include the launch
                continue
            elif m > 1 and g > 1 and self.hierarchical:
                cands = [hierarchical_terms(kind, g, m, intra, inter, a) for a in algos]
            else:
                bw, lat = link
                cands = [collective_terms(kind, n, bw, lat, a) for a in algos]
            if n > 1 and fit is None:
                cands = [(f + hw.collective_launch_s, p) for f, p in cands]
            terms[kind] = cands
        return terms

    def p2p(self, nbytes: float, same_node: bool = True) -> float:
        """Seconds of one point-to-point message of ``nbytes`` between two ranks (a measured
        ``send_recv`` fit for ranks on one node when the profile has one)."""
        hw = self.hardware
        fit = hw.collective_fit("send_recv", 2) if same_node else None
        if fit is not None:
            return fit[0] + fit[1] * nbytes
        if hw.collective_model == "nccl":
            return nccl_p2p_seconds(hw, nbytes, same_node)
        bw, lat = ((hw.intra_node_bandwidth, hw.intra_node_latency) if same_node
                   else (hw.inter_node_bandwidth, hw.inter_node_latency))
        return p2p_seconds(nbytes, bw, lat, hw.collective_launch_s)

    # ---- placements ----------------------------------------------------------------------------
    def shard_factor(self, pls: Sequence[Placement], skip: Optional[int] = None) -> int:
        """How many pieces ``pls`` cuts a tensor into (ignoring axis ``skip``)."""
        return self._factor(encode(pls), skip)

    def _group(self, axis) -> int:
        """Ranks in one group over mesh ``axis`` (or a tuple of axes flattened)."""
        return self.mesh.shape[axis] if isinstance(axis, int) else math.prod(self.mesh.shape[a] for a in axis)

    def _factor(self, codes: Sequence[int], skip=None) -> int:
        skip = () if skip is None else (skip,) if isinstance(skip, int) else skip
        f = 1
        for a, c in enumerate(codes):
            if c >= 0 and a not in skip:
                f *= self.mesh.shape[a]
        return f

    def local_bytes(self, nbytes: float, codes: Sequence[int]) -> float:
        """Bytes per rank of a tensor of ``nbytes`` at placement codes ``codes`` (see ``encode``)."""
        return nbytes / self._factor(codes)

    def work_divisor(self, strategy: Strategy) -> int:
        """Product of the sizes of the axes where some operand or output is S or P."""
        split = set()
        for pls in (*strategy.inputs, *strategy.outputs):
            for a, c in enumerate(encode(pls)):
                if c != R_CODE:
                    split.add(a)
        return math.prod(self.mesh.shape[a] for a in split)

    # ---- collectives ---------------------------------------------------------------------------
    def collective_time(self, kind: str, axis, nbytes: float) -> float:
        """Seconds of one ``kind`` over mesh axis ``axis`` (or a tuple of axes flattened into one
        group) with full per-group bytes ``nbytes``."""
        return min(f + p * nbytes for f, p in self._terms_of(axis)[kind])

    def _flat_fit(self, kind: str, axes: Sequence[int]) -> Optional[tuple[float, float]]:
        """The measured (latency_s, seconds_per_byte) of ``kind`` over several mesh axes flattened,
        when the profile has a fit for the group's size and the group lies inside one node."""
        n = math.prod(self.mesh.shape[a] for a in axes)
        if n > self.hardware.devices_per_node or any(self.hardware.axis_locality(self.mesh, a)[1] > 1 for a in axes):
            return None
        return self.hardware.collective_fit(kind, n)

    def flat_collective_time(self, kind: str, axes: Sequence[int], nbytes: float) -> float:
        """Seconds of one ``kind`` over mesh axes ``axes`` flattened into one group (the runtime's
        fused parameter gathers: ``runtime.param_gather``), full per-group bytes ``nbytes``: one
        collective over the flattened group (``collective_time`` of the axes' tuple: a measured fit
        for the group's size inside one node, else NCCL's or the link model's price for the group's
        members per node and nodes). An all-reduce without a fit is priced one axis after the other,
        whole, as ``grad_sync`` prices gradient syncs (its docstring says why)."""
        axes = sorted(a for a in axes if self.mesh.shape[a] > 1)
        if not axes:
            return 0.0
        if len(axes) == 1:
            return self.collective_time(kind, axes[0], nbytes)
        if kind == "all_reduce" and self._flat_fit(kind, axes) is None:
            # as ``grad_sync`` prices a gradient replicated on several axes: each axis in turn, whole
            return sum(self.collective_time(kind, a, nbytes) for a in axes)
        return self.collective_time(kind, tuple(axes), nbytes)

    def _terms_of(self, axis) -> dict[str, list[tuple[float, float]]]:
        if isinstance(axis, int):
            return self._terms[axis]
        terms = self._flat_terms.get(axis)
        if terms is None:
            terms = self._flat_terms[axis] = self._axis_terms(axis)
        return terms

    def collective(self, kind: str, axis, nbytes: float, phase: str = "fwd") -> Collective:
        # the runtime dispatches each collective as one op (an autograd function): one launch more
        secs = self.collective_time(kind, axis, nbytes) + self.hardware.op_overhead_s
        return Collective(kind, axis, int(nbytes), secs, phase)

    def reshard(self, src: Sequence[Placement], dst: Sequence[Placement], meta: TensorMeta,
                needs_grad: bool) -> tuple[Collective, ...]:
        """The collectives that move a tensor from ``src`` to ``dst`` placements, forward then backward."""
        return self.moves(encode(src), encode(dst), meta.nbytes, needs_grad)[0]

    def reshard_memory(self, src, dst, meta: TensorMeta) -> float:
        """Bytes of the redistributed local copy when the move communicates (a free chunk is a view)."""
        return self.moves(encode(src), encode(dst), meta.nbytes, False)[1]

    def moves(self, src: tuple, dst: tuple, nbytes: int, needs_grad: bool, *, grad_scale: float = 1.0,
              cast: bool = False) -> tuple[tuple[Collective, ...], float]:
        """(collectives, copy bytes) between placement codes (see ``encode``), cached. ``grad_scale``:
        the gradient's bytes per forward byte (a parameter's gradient reduced in another dtype);
        ``cast``: the value is cast on the way (a parameter's compute copy), so even a move
        without communication makes a copy."""
        if src == dst and not cast:
            return (), 0.0
        key = (src, dst, nbytes, needs_grad, grad_scale, cast)
        hit = self._reshard_cache.get(key)
        if hit is None:
            hit = self._reshard_cache[key] = self._moves(src, dst, nbytes, needs_grad, grad_scale, cast)
        return hit

    def _moves(self, src, dst, nbytes: int, needs_grad: bool, grad_scale: float = 1.0,
               cast: bool = False) -> tuple[tuple[Collective, ...], float]:
        cur = list(src)
        fwd: list[Collective] = []
        steps = self._reshard_cache.get(("steps", src, dst))
        if steps is None:
            steps = self._reshard_cache[("steps", src, dst)] = redistribution_steps(src, dst, self.mesh.shape)
        flat = fused_gather(steps)
        if flat is not None and len(flat[0]) > 1:  # one all-gather over the axes flattened, as the runtime runs it
            steps = ()
            fwd.append(self.collective("all_gather", flat[0], nbytes / self._factor(cur, skip=flat[0])))
        dims = [None] * len(fwd)
        for step in steps:
            kind, a = step.kind, step.axis
            if kind in ADJOINT:
                fwd.append(self.collective(kind, a, nbytes / self._factor(cur, skip=a)))
                dims.append(step.dim)
            cur[a] = R_CODE if kind == "all_gather" else dst[a]
        copy = nbytes / self._factor(dst) if fwd or cast else 0.0
        if needs_grad:
            back = [self.collective(ADJOINT[c.kind], c.axis, c.bytes * grad_scale, "bwd") for c in reversed(fwd)]
            fwd, dims = fwd + back, dims + dims[::-1]
        # the runtime's layout copies and dispatches around each call (passes/cost/runtime_host.py)
        fwd = [replace(c, seconds=c.seconds + step_host_seconds(self.hardware, c.kind, d, c.bytes, self._group(c.axis)))
               for c, d in zip(fwd, dims)]
        return tuple(fwd), copy

    def bucketed_seconds(self, kind: str, axes: Sequence[int], nbytes: float, total_bytes: Optional[float]) -> float:
        """Seconds one tensor of ``nbytes`` (full per-group bytes) adds to a bucketed ``kind`` over
        ``axes`` flattened: the bandwidth term whole, the fixed term in proportion to its share of a
        bucket (``grad_bucket_bytes``, at most ``total_bytes``), as ``grad_sync`` prices a gradient."""
        axes = tuple(sorted(a for a in axes if self.mesh.shape[a] > 1))
        if not axes:
            return 0.0
        bucket = self.grad_bucket_bytes if not total_bytes else max(1.0, min(self.grad_bucket_bytes, total_bytes))
        share = min(1.0, nbytes / bucket)
        fixed, per_byte = min(self._terms_of(axes[0] if len(axes) == 1 else axes)[kind],
                              key=lambda t: t[0] + t[1] * nbytes)
        return per_byte * nbytes + share * fixed

    def grad_sync(self, meta: TensorMeta, storage: Sequence[Placement],
                  total_bytes: Optional[float] = None) -> tuple[Collective, ...]:
        """All-reduce of a parameter's gradient over the axes (size > 1) where it is stored R, as one
        collective: the runtime's ``GradSync`` all-reduces once over those axes flattened (one bucket
        per group of axes). With a measured fit for the flattened group (inside one node) that fit
        prices it; otherwise it is priced one axis after the other, whole, which overstates it across
        nodes on purpose: pricing the flat call makes replicated weights win the unconstrained solve
        for Llama-3 8B on (8, 8), which then does not fit memory, and the lever search's memory-bound
        solve took 410 s instead of 5 s (see benchmarks/RESULTS.md).

        The runtime buckets gradients (``grad_bucket_bytes``, DDP's 25 MiB default), so a gradient
        pays the latency and launch cost of one all-reduce only in proportion to the bucket share it
        fills; the bandwidth term is paid in full. A bucket holds at most ``total_bytes`` (all the
        model's parameter bytes, when given): a small model still pays one whole all-reduce."""
        local = meta.nbytes * self.reduce_scale(meta) / self.shard_factor(storage)
        total = None if not total_bytes else total_bytes * self.reduce_scale(meta)  # in the reduce dtype too
        bucket = self.grad_bucket_bytes if not total else max(1.0, min(self.grad_bucket_bytes, total))
        share = min(1.0, local / bucket)
        axes = [a for a, p in enumerate(storage) if placement_code(p) == R_CODE and self.mesh.shape[a] > 1]
        if not axes:
            return ()
        copy_in = self.hardware.op_overhead_s  # the hook copying the gradient into its bucket: one launch
        fit = self._flat_fit("all_reduce", axes) if len(axes) > 1 else None
        if fit is not None:
            seconds = fit[1] * local + share * fit[0]
        else:  # one axis, or no fit for the flattened group: each axis in turn, whole
            seconds = 0.0
            for a in axes:
                fixed, per_byte = min(self._terms[a]["all_reduce"], key=lambda t: t[0] + t[1] * local)
                seconds += per_byte * local + share * fixed
        return (Collective("all_reduce", axes[0], int(local), seconds + copy_in),)

    # ---- whole nodes and edges ----------------------------------------------------------------
    def price_node(self, name: str, strategy: Strategy, facts: GraphFacts) -> NodePrice:
        kind = facts.kind[name]
        metas = facts.tensor_outputs(name)
        if kind == "param" and metas and not facts.training:  # inference: no gradient, no optimizer state
            return NodePrice(compute=facts.overhead(name), params=self.param_memory(metas[0], strategy.outputs[0])[0])
        if kind == "param" and metas and any(strategy.lowerings):  # ZeRO-1/2, reduce once per step
            return NodePrice(compute=facts.overhead(name), **storage_price(self, name, strategy, facts))
        if kind == "param" and metas:
            master = facts.master_dtype(name)
            p, g, o = self.param_memory(metas[0], strategy.outputs[0], master)
            syncs = self.grad_sync(metas[0], strategy.outputs[0], facts.param_bytes)
            step = self.param_step_seconds(metas[0], strategy.outputs[0], master) if self.price_step else 0.0
            return NodePrice(compute=facts.overhead(name) + step, grad_sync=syncs, params=p, grads=g, optimizer=o)
        if kind == "buffer" and metas:
            return NodePrice(params=metas[0].nbytes / self.shard_factor(strategy.outputs[0]))
        if kind != "op":
            return NodePrice()
        fwd, bwd = facts.compute(name)
        work, colls, moved = (fwd + bwd) / self.work_divisor(strategy), (), 0.0
        dims = facts.gemm_dims.get(name)
        if dims is not None:  # the shard's own shape sets its tile and wave efficiency
            work *= self.gemm_shard_factor(name, dims, strategy)
        node = facts.nodes[name]
        if is_moe_node(node):  # the busiest rank's share under expert-load imbalance (or capacity padding)
            work *= work_factor(node, strategy, self.mesh.shape)
        if fwd + bwd > 0 and self.hardware.min_kernel_s:  # however small its shard, a kernel lasts this long
            work = max(work, facts.launches(name) * self.hardware.min_kernel_s)
        extra = 0.0
        if any(strategy.lowerings):  # what a special lowering costs beyond its placements (passes/cost/lowerings.py)
            for low in named_lowerings(strategy):
                if low.price is not None:
                    extra += low.price(self, node, strategy, fwd, bwd)
                if low.collectives is not None:
                    colls += low.collectives(self, node, strategy, metas[0], facts.training)
                if low.saved_bytes is not None and facts.training:
                    moved += self.kept(low.saved_bytes(self, node, strategy, metas[0]))
        return NodePrice(compute=work + facts.overhead(name) + extra, collectives=colls,
                         activations=self.node_activation_bytes(name, strategy, facts) + moved)

    def param_step_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None) -> float:
        """Seconds one parameter's local shard adds to a step outside the program: the optimizer's update
        (``passes/cost/optimizer_step.py``); under accumulation ``MicrobatchCostModel`` adds the gradient
        adds between microbatches, as each microbatch's share."""
        return self.optimizer_step_seconds(meta, storage, master_dtype)

    def optimizer_step_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None) -> float:
        """Seconds of the optimizer step over one parameter's local shard (memory-bound, per step)."""
        stored = master_dtype if master_dtype is not None else meta.dtype
        if not stored.is_floating_point:
            return 0.0
        local = meta.numel / self.shard_factor(storage)
        return self._streamed(local * optimizer_step_bytes(self.optimizer, TensorMeta((), stored).nbytes))

    def accumulate_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None) -> float:
        """Seconds of adding one microbatch's gradient of a parameter into its stored gradient (local shard)."""
        stored = master_dtype if master_dtype is not None else meta.dtype
        if not stored.is_floating_point:
            return 0.0
        local = meta.numel / self.shard_factor(storage)
        return self._streamed(local * accumulation_bytes(meta.dtype.itemsize, TensorMeta((), stored).nbytes))

    def _streamed(self, nbytes: float) -> float:
        """Seconds of an elementwise pass moving ``nbytes`` (``kernel_classes``; plain bandwidth without
        the achievable model)."""
        if achievable(self.hardware):
            return class_seconds(self.hardware, "elementwise", nbytes)
        return nbytes / self.hardware.memory_bandwidth

    def gemm_shard_factor(self, name: str, dims: tuple, strategy: Strategy) -> float:
        """Seconds of one rank's GEMM shard per second of the whole GEMM's achieved time divided
        evenly: the efficiency the whole op was priced at (``facts.gemm_dims``) / the efficiency of
        the shard's shape (cached)."""
        codes = encode(strategy.outputs[0]) if strategy.outputs else ()
        key = ("gemm", dims, codes)
        hit = self._reshard_cache.get(key)
        if hit is None:
            local = local_gemm_dims(dims, codes, self.mesh.shape)
            hit = self._reshard_cache[key] = dims[6] / gemm_efficiency(self.hardware, *local)
        return hit

    def price_edge(self, src, dst, meta: TensorMeta, needs_grad: bool) -> tuple[tuple[Collective, ...], float]:
        """(collectives, bytes of the redistributed copy) to move one operand from ``src`` to ``dst``."""
        return self.moves(encode(src), encode(dst), meta.nbytes, needs_grad)

    # ---- memory --------------------------------------------------------------------------------
    def param_memory(self, meta: TensorMeta, storage: Sequence[Placement],
                     master_dtype=None) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer-state) bytes per rank for one parameter; ``master_dtype``:
        the dtype the parameter and its gradient are kept in when the graph computes with a cast copy."""
        f = self.shard_factor(storage)
        own = meta.nbytes if master_dtype is None else TensorMeta(meta.shape, master_dtype).nbytes
        return own / f, own / f, meta.numel * self.opt_bytes / f

    def reduce_scale(self, meta: TensorMeta) -> float:
        """Bytes of a parameter's reduced gradient per byte of its compute copy: gradients are
        reduced in ``reduce_dtype`` when one is given (mixed precision), else in the graph's dtype."""
        if self.reduce_dtype is None or not meta.dtype.is_floating_point:
            return 1.0
        return TensorMeta((1,), self.reduce_dtype).nbytes / TensorMeta((1,), meta.dtype).nbytes

    def activation_bytes(self, metas: Sequence[TensorMeta], placements: Sequence[Sequence[Placement]]) -> float:
        """Local bytes of tensors ``metas`` kept for backward, each at its ``placements``."""
        return self.kept(sum(m.nbytes / self.shard_factor(pls) for m, pls in zip(metas, placements)))

    def kept(self, nbytes: float) -> float:
        """Bytes per device that ``nbytes`` of one step's activations amount to (a pipeline stage
        holding several microbatches counts them that many times)."""
        return nbytes

    def node_activation_bytes(self, name: str, strategy: Strategy, facts: GraphFacts) -> float:
        """Local bytes autograd keeps of op ``name``'s own outputs and of the tensors it creates
        inside itself (``facts.saved_of``; the internal ones split like the op's work). Without the
        saved-tensor analysis: every output of every op that is not a view."""
        metas = facts.tensor_outputs(name)
        info = facts.saved_of(name)
        if info is None:
            return 0.0 if name in facts.views else self.activation_bytes(metas, strategy.outputs)
        kept = self.activation_bytes([metas[s] for s in info.saved_outputs],
                                     [strategy.outputs[s] for s in info.saved_outputs])
        internal = facts.internal_bytes(name)
        for low in named_lowerings(strategy) if any(strategy.lowerings) else ():
            if low.internal_bytes is not None:
                internal = low.internal_bytes(facts.nodes[name])
        return kept + self.kept(internal / self.work_divisor(strategy))

    def edge_activation_bytes(self, copy_bytes: float, facts: GraphFacts, consumer: str, index: int) -> float:
        """Bytes of a redistributed copy kept for backward: all of it when the consumer keeps that
        operand (``facts.operand_saved``), else none (the copy is freed after its use)."""
        return copy_bytes if facts.operand_saved(consumer, index) else 0.0
