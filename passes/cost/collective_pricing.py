"""Collective pricing for one mesh and hardware: collectives, redistributions and gradient syncs.

``CollectivePricing(mesh, hardware)`` holds each mesh axis' collective terms (kind -> candidate
(fixed seconds, seconds per byte); a call costs the cheapest candidate): a measured fit in the
hardware's profile, else NCCL's tuner model (``passes/cost/nccl.py``) on hardware with
``collective_model="nccl"``, else the link formulas (``passes/cost/collectives.py``), hierarchical
across nodes. ``passes/cost/model.py``'s ``CostModel`` extends it with node prices and memory.

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
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from autoshard.passes.cost.collectives import Collective, collective_terms, hierarchical_terms, p2p_seconds
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.nccl import nccl_p2p_seconds, nccl_terms
from autoshard.passes.cost.runtime_host import step_host_seconds
from autoshard.passes.layout.gathers import fused_gather
from autoshard.passes.layout.redistribution import R_CODE, encode, placement_code, redistribution_steps
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Placement, Strategy, TensorMeta

__all__ = ["ADJOINT", "CollectivePricing"]

ADJOINT = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
           "all_reduce": "all_reduce", "all_to_all": "all_to_all"}


class CollectivePricing:
    """Prices collectives, redistributions and gradient syncs on one mesh and hardware (caches per
    instance; ``move_cache`` may be shared by instances of one mesh, hardware and collective settings:
    a move's price depends on nothing else)."""

    def __init__(self, mesh: Mesh, hardware: Hardware, *, grad_bucket_bytes: float = 25 * 2 ** 20,
                 hierarchical: bool = True, reduce_dtype=None, accumulate_in_reduce_dtype: bool = False,
                 move_cache: Optional[dict] = None):
        self.mesh = mesh
        self.hardware = hardware
        self.reduce_dtype = reduce_dtype
        #: gradients are accumulated and held in ``reduce_dtype`` (``passes.levers.MixedPrecision``)
        self.accumulate_in_reduce_dtype = bool(accumulate_in_reduce_dtype and reduce_dtype is not None)
        self.grad_bucket_bytes = grad_bucket_bytes
        self.hierarchical = hierarchical
        self.links = [hardware.axis_link(mesh, a) for a in range(mesh.ndim)]
        self._terms = [self._axis_terms(a) for a in range(mesh.ndim)]
        self._flat_terms: dict[tuple[int, ...], dict] = {}  # several axes flattened -> their terms
        self._reshard_cache: dict = {} if move_cache is None else move_cache  # (collectives, copy) per move

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

    def reduce_scale(self, meta: TensorMeta) -> float:
        """Bytes of a parameter's reduced gradient per byte of its compute copy: gradients are
        reduced in ``reduce_dtype`` when one is given (mixed precision), else in the graph's dtype."""
        if self.reduce_dtype is None or not meta.dtype.is_floating_point:
            return 1.0
        return TensorMeta((1,), self.reduce_dtype).nbytes / TensorMeta((1,), meta.dtype).nbytes
