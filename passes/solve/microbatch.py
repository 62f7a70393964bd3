"""How a plan made on the global batch relates to one microbatch.

The program is captured once, at the global batch ``B``. A pipeline (and gradient accumulation)
runs it on microbatches of ``B / m`` sequences, so three things must follow the microbatch:

- cost: compute and tensor bytes of everything computed from the inputs shrink by ``m``
  (``MicrobatchFacts``); the step's gradient all-reduces are shared by the ``m`` microbatches and
  the activations of ``held`` microbatches are alive at once (``MicrobatchCostModel``);
- validity: a sharding that splits a batch-sized dimension must still divide it at the microbatch.
  Splitting 16 sequences 8 ways is fine for the global batch and impossible for a microbatch of
  one (``microbatch_strategies`` keeps the ILP to strategies valid at the planned microbatch);
- granularity: the microbatch sizes a finished plan stays valid for (``batch_granularity``).

Convention (the runtime splits inputs on dim 0 the same way): dim 0 of a value computed from the
inputs carries the batch, whole sequences ``[b, ...]`` or flattened tokens ``[b * s, ...]``.
A value whose dim 0 is not a multiple of the batch is taken not to carry it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Union

import torch

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel
from autoshard.passes.errors import AutoshardError
from autoshard.passes.graph import CapturedGraph, operand_meta, operands, outputs
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Shard, TensorMeta
from autoshard.passes.sharding.strategies import StrategyTable

__all__ = ["global_batch", "batch_dependent", "MicrobatchFacts", "MicrobatchCostModel", "microbatch_strategies",
           "BatchSplits",
           "batch_granularity", "strategies_granularity", "batch_divisors"]


def global_batch(captured: CapturedGraph) -> int:
    """Dim 0 of the first user input (the dimension microbatches cut)."""
    for name in captured.inputs:
        meta = captured.node(name).meta.get("autoshard.meta")
        if meta is not None and getattr(meta, "shape", None):
            return int(meta.shape[0])
    raise AutoshardError("microbatches (pipeline stages, gradient accumulation) cut dim 0 of the inputs: the "
                         "program needs a batched tensor input")


def batch_dependent(captured: CapturedGraph) -> set[str]:
    """Names of the nodes computed from a user input or the target, or broadcast to the batch, and
    what is computed from them (their size follows the batch).

    Broadcast to the batch: an ``expand`` (or a ``repeat``) of a size-1 dim 0 to the global batch.
    HF's causal mask is built from positions alone and expanded to the input's batch size; traced at
    a microbatch it is expanded to the microbatch's, so it follows the batch like the inputs do
    (priced as fixed, a Llama's (batch, 1, seq, seq) mask crossed every pipeline cut at the global
    batch's size). A tensor made with a literal batch size (``torch.ones(batch, seq)``) is not
    recognised: after tracing, its size is a number like any other."""
    found = set(captured.inputs) | ({captured.target} if captured.target else set())
    batch = None
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if any(a.name in found for a in node.all_input_nodes):
            found.add(node.name)
        elif node.target in _TO_THE_BATCH:
            batch = global_batch(captured) if batch is None else batch
            if _broadcasts_to(node, batch):
                found.add(node.name)
    return found


#: ops that can copy or broadcast one row to every row of the batch (dim 0: 1 -> batch)
_TO_THE_BATCH = (torch.ops.aten.expand.default, torch.ops.aten.repeat.default)


def _broadcasts_to(node, batch: int) -> bool:
    """Whether ``node`` (an expand or a repeat) turns a size-1 dim 0 into ``batch``."""
    src = node.args[0].meta.get("autoshard.meta") if hasattr(node.args[0], "meta") else None
    out = node.meta.get("autoshard.meta")
    shape_in, shape_out = getattr(src, "shape", None), getattr(out, "shape", None)
    return (batch > 1 and bool(shape_in) and bool(shape_out) and len(shape_in) == len(shape_out)
            and int(shape_in[0]) == 1 and int(shape_out[0]) == batch)


@dataclass(frozen=True)
class _ScaledMeta(TensorMeta):
    """A tensor of one microbatch: ``nbytes`` is the global tensor's times ``scale``."""
    scale: float = 1.0

    @property
    def nbytes(self) -> float:
        return TensorMeta.nbytes.fget(self) * self.scale


class MicrobatchFacts(GraphFacts):
    """GraphFacts of one microbatch: batch-dependent compute and tensor bytes divided by ``m`` (a
    tensor's bytes only when its dim 0 carries the batch: a mean loss stays one scalar)."""

    def __init__(self, captured: CapturedGraph, hardware: Hardware, m: int):
        super().__init__(captured, hardware)
        self._batch = batch_dependent(captured)
        self._m = m
        self._scaled: dict = {}
        self._global_batch = global_batch(captured)
        for name, dims in list(self.gemm_dims.items()):  # a microbatch's GEMM has 1/m of the batch rows
            if name in self._batch:
                batch, rows = dims[0], dims[1]
                if batch > 1 and batch % m == 0:
                    batch //= m
                else:
                    rows = max(1, rows // m)
                self.gemm_dims[name] = (batch, rows, *dims[2:])

    def compute(self, name: str) -> tuple[float, float]:
        fwd, bwd = super().compute(name)
        return (fwd / self._m, bwd / self._m) if name in self._batch else (fwd, bwd)

    def tensor_outputs(self, name: str) -> list:
        metas = super().tensor_outputs(name)
        if name not in self._batch:
            return metas
        if name not in self._scaled:
            self._scaled[name] = [_ScaledMeta(m.shape, m.dtype, 1.0 / self._m)
                                  if m.shape and m.shape[0] % self._global_batch == 0 else m for m in metas]
        return self._scaled[name]

    def internal_bytes(self, name: str) -> float:
        b = super().internal_bytes(name)
        return b / self._m if name in self._batch else b

    def selective_bytes(self, name: str) -> float:
        b = super().selective_bytes(name)
        return b / self._m if name in self._batch else b


class MicrobatchCostModel(CostModel):
    """Prices one of ``m`` microbatches of a step: each gradient all-reduce runs once per step, so a
    microbatch carries ``1/m`` of it; the activations of ``held`` microbatches are alive at once
    (a pipeline stage's in-flight microbatches; 1 under gradient accumulation)."""

    def __init__(self, mesh: Mesh, hardware: Hardware, optimizer: Union[str, float], m: int, held: int = 1,
                 **options):
        super().__init__(mesh, hardware, optimizer, **options)
        self.microbatches, self.held = m, held

    def grad_sync(self, *args, **kwargs):
        return tuple(replace(c, seconds=c.seconds / self.microbatches) for c in super().grad_sync(*args, **kwargs))

    def param_step_seconds(self, meta, storage, master_dtype=None, accumulated=None) -> float:
        """Per microbatch: ``1/m`` of the optimizer step and ``(m-1)/m`` of one gradient accumulation
        (every microbatch after the first adds its gradient into the stored one, held as ``accumulated``
        places it: ``storage`` when None)."""
        m = self.microbatches
        held = storage if accumulated is None else accumulated
        return (self.optimizer_step_seconds(meta, storage, master_dtype) / m
                + self.accumulate_seconds(meta, held, master_dtype) * (m - 1) / m)

    def kept(self, nbytes: float) -> float:
        return self.held * nbytes


def _dim0_ways(pls, mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a, p in enumerate(pls) if isinstance(p, Shard) and p.dim == 0)


def _batch_values(node, strategy, batch: set[str]) -> Iterator[tuple[TensorMeta, tuple]]:
    """(meta, placements) of every batch-dependent value the strategy produces or reads."""
    if node.name in batch:
        for meta, pls in zip(outputs(node), strategy.outputs):
            if isinstance(meta, TensorMeta) and meta.shape:
                yield meta, pls
    if node.op == "call_function":
        for op, pls in zip(operands(node), strategy.inputs):
            if op.node.name in batch:
                meta = operand_meta(op)
                if isinstance(meta, TensorMeta) and meta.shape:
                    yield meta, pls


def microbatch_strategies(captured: CapturedGraph, table: StrategyTable, mesh: Mesh,
                          microbatches: int) -> dict[str, set[int]]:
    """``node -> allowed strategy indices`` for every node with a strategy that splits dim 0 of a
    batch-dependent value more ways than that dim has at the microbatch (``dim0 / microbatches``).
    The all-replicated strategy always stays."""
    return BatchSplits(captured, table, mesh).allowed(microbatches)


class BatchSplits:
    """Every strategy's splits of batch-dependent dims (``(dim 0, ways)`` with ``ways > 1``), worked
    out once, so ``allowed(m)`` (``microbatch_strategies``) is cheap for many microbatch counts."""

    def __init__(self, captured: CapturedGraph, table: StrategyTable, mesh: Mesh):
        batch = batch_dependent(captured)
        nodes = {n.name: n for n in captured.gm.graph.nodes}
        self.splits: dict[str, list[list[tuple[int, int]]]] = {}
        for name, strategies in table.items():
            per = []
            for s in strategies:
                found = [(meta.shape[0], ways) for meta, pls in _batch_values(nodes[name], s, batch)
                         if (ways := _dim0_ways(pls, mesh)) > 1]
                per.append(found)
            if any(per):
                self.splits[name] = per

    def allowed(self, microbatches: int) -> dict[str, set[int]]:
        """``microbatch_strategies(..., microbatches)``."""
        m = microbatches
        allowed: dict[str, set[int]] = {}
        for name, per in self.splits.items():
            keep = {k for k, found in enumerate(per) if not any(d % m == 0 and (d // m) % ways for d, ways in found)}
            if len(keep) < len(per):
                allowed[name] = keep
        return allowed


def batch_granularity(captured: CapturedGraph, solution) -> int:
    """The smallest microbatch (in sequences) that every batch-dim split of ``solution`` (a
    ``solve.solution.Solution``: its strategies and mesh) divides:
    microbatch sizes that are multiples of it keep the plan valid. A value of ``k * b`` rows split
    ``f`` ways needs ``b`` to be a multiple of ``f / gcd(f, k)``."""
    return strategies_granularity(captured, solution.strategies, solution.mesh)


def strategies_granularity(captured: CapturedGraph, strategies: dict, mesh: Mesh) -> int:
    """``batch_granularity`` of an assignment (node -> Strategy) on ``mesh``."""
    batch, batch_size = batch_dependent(captured), global_batch(captured)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    grain = 1
    for name, strategy in strategies.items():
        for meta, pls in _batch_values(nodes[name], strategy, batch):
            ways = _dim0_ways(pls, mesh)
            if ways > 1 and meta.shape[0] % batch_size == 0:
                need = ways // math.gcd(ways, meta.shape[0] // batch_size)
                grain = grain * need // math.gcd(grain, need)
    return grain


def batch_divisors(captured: CapturedGraph) -> list[int]:
    """The microbatch counts the global batch allows: the divisors of dim 0 of the first input."""
    b = global_batch(captured)
    return [k for k in range(1, b + 1) if b % k == 0]
