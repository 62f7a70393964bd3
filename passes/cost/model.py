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

Collectives, redistributions and gradient syncs are priced by ``CollectivePricing``
(``passes/cost/collective_pricing.py``), which ``CostModel`` extends.

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

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from autoshard.passes.cost.collective_pricing import ADJOINT, CollectivePricing
from autoshard.passes.cost.collectives import Collective
from autoshard.passes.cost.facts import GraphFacts, local_gemm_dims
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.kernel_classes import class_seconds
from autoshard.passes.cost.kernels import achievable, gemm_efficiency
from autoshard.passes.cost.optimizer_step import accumulation_bytes, optimizer_step_bytes
from autoshard.passes.cost.lowerings import named_lowerings
from autoshard.passes.cost.moe import is_moe_node, work_factor
from autoshard.passes.cost.storage_prices import storage_price
from autoshard.passes.layout.redistribution import encode, placement_code
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Strategy, TensorMeta

__all__ = ["optimizer_state_bytes", "gradient_precision", "CostModel", "NodePrice", "ADJOINT", "encode", "placement_code"]


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


def gradient_precision(mixed_precision) -> dict:
    """``CostModel`` keywords for how ``mixed_precision`` (``passes.levers.MixedPrecision``, or None)
    reduces and holds gradients: ``reduce_dtype`` and ``accumulate_in_reduce_dtype``."""
    if mixed_precision is None:
        return {}
    return {"reduce_dtype": mixed_precision.reduce_dtype,
            "accumulate_in_reduce_dtype": mixed_precision.accumulate_in_reduce_dtype}


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


class CostModel(CollectivePricing):
    """Prices strategies and redistributions for one mesh and hardware (caches per instance): node
    prices and memory here, collectives and moves in ``CollectivePricing``."""

    def __init__(self, mesh: Mesh, hardware: Hardware, optimizer: Union[str, float] = "adamw", *,
                 grad_bucket_bytes: float = 25 * 2 ** 20, hierarchical: bool = True, reduce_dtype=None,
                 accumulate_in_reduce_dtype: bool = False, move_cache: Optional[dict] = None,
                 price_step: bool = True):
        super().__init__(mesh, hardware, grad_bucket_bytes=grad_bucket_bytes, hierarchical=hierarchical,
                         reduce_dtype=reduce_dtype, accumulate_in_reduce_dtype=accumulate_in_reduce_dtype,
                         move_cache=move_cache)
        self.opt_bytes = optimizer_state_bytes(optimizer)
        self.optimizer = optimizer
        #: a parameter's price includes its optimizer step (``param_step_seconds``); False for a caller that
        #: adds it elsewhere (the stage planner's candidates price it, as their stage scorer charges it)
        self.price_step = price_step

    # ---- whole nodes and edges ----------------------------------------------------------------
    def price_node(self, name: str, strategy: Strategy, facts: GraphFacts) -> NodePrice:
        kind = facts.kind[name]
        metas = facts.tensor_outputs(name)
        if kind == "param" and metas and not facts.training:  # inference: no gradient, no optimizer state
            return NodePrice(compute=facts.overhead(name), params=self.param_memory(metas[0], strategy.outputs[0])[0])
        if kind == "param" and metas and any(strategy.lowerings):  # ZeRO-1/2, reduce once per step
            price = storage_price(self, name, strategy, facts)
            return NodePrice(compute=facts.overhead(name) + price.pop("step_seconds"), **price)
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

    def param_step_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None,
                           accumulated: Optional[Sequence[Placement]] = None) -> float:
        """Seconds one parameter's local shard adds to a step outside the program: the optimizer's update
        (``passes/cost/optimizer_step.py``); under accumulation ``MicrobatchCostModel`` adds the gradient
        adds between microbatches, as each microbatch's share, into the gradient as it is held between
        them (``accumulated``: its placements when they are not ``storage``'s, e.g. a ``zero1``
        parameter's unreduced gradient, whole over the ZeRO axes whose slice the optimizer updates)."""
        return self.optimizer_step_seconds(meta, storage, master_dtype)

    def optimizer_step_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None) -> float:
        """Seconds of the optimizer step over one parameter's local shard (memory-bound, per step)."""
        stored = master_dtype if master_dtype is not None else meta.dtype
        if not stored.is_floating_point:
            return 0.0
        local = meta.numel / self.shard_factor(storage)
        return self._streamed(local * optimizer_step_bytes(self.optimizer, TensorMeta((), stored).nbytes))

    def grad_dtype(self, meta: TensorMeta, master_dtype=None):
        """The dtype a parameter's gradient is accumulated and held in until the optimizer step: its
        master dtype (the parameter's own, None: the graph's), or ``reduce_dtype`` where gradients are
        accumulated in it (``accumulate_in_reduce_dtype``: Megatron-LM's fp32 main gradients)."""
        if self.accumulate_in_reduce_dtype and meta.dtype.is_floating_point:
            return self.reduce_dtype
        return master_dtype if master_dtype is not None else meta.dtype

    def accumulate_seconds(self, meta: TensorMeta, storage: Sequence[Placement], master_dtype=None) -> float:
        """Seconds of adding one microbatch's gradient of a parameter into its stored gradient (local shard,
        held in ``grad_dtype``)."""
        stored = self.grad_dtype(meta, master_dtype)
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
        the dtype the parameter and its gradient are kept in when the graph computes with a cast copy; the
        gradient is held in ``grad_dtype``."""
        f = self.shard_factor(storage)
        own = meta.nbytes if master_dtype is None else TensorMeta(meta.shape, master_dtype).nbytes
        return own / f, self.grad_bytes(meta, master_dtype) / f, meta.numel * self.opt_bytes / f

    def grad_bytes(self, meta: TensorMeta, master_dtype=None) -> float:
        """Bytes of a parameter's whole gradient as held (``grad_dtype``)."""
        dtype = self.grad_dtype(meta, master_dtype)
        return meta.nbytes if dtype is meta.dtype else TensorMeta(meta.shape, dtype).nbytes

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
