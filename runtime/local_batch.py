"""Per-rank data: which mesh axes are data parallel, and programs that take only this rank's slice.

A *batch input* is a user input or the target whose dim 0 is the batch: it has as many rows as the
first tensor input. The **data-parallel axes** of a plan are the mesh axes of size > 1 on which every
op reading a batch input reads it as ``Shard(0)``: along them each rank needs only its own rows. Their sizes
multiply to ``data_parallel_size``; a rank's ``data_parallel_rank`` is the row-major index of its
coordinates on them, in axis order (the order in which ``S(0)`` on several axes nests), so with a
global batch of ``B`` rows, data-parallel rank ``r`` owns rows ``[r * B / size, (r + 1) * B / size)``:
exactly what ``torch.utils.data.DistributedSampler(num_replicas=size, rank=r)`` hands it, given
contiguous shards.

With ``local_batch=True`` a rank passes only those rows of every batch input; other inputs whole. The
program is lowered once more with the batch inputs *arriving* as ``S(0)`` on the data-parallel axes
(``lower(..., arrivals=...)``): each reader takes its operand from the slice, with the free local chunk
the full-batch program would have cut from the whole batch, so nothing is gathered and the step equals
the full-batch step.

Ranks that differ only along the other axes (tensor parallel, or an axis where some batch input is
replicated) must pass the same slice. Each local step checks it: one small all-reduce over those axes
compares a checksum of every input, and a mismatch is a ``BatchError`` naming the input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from autoshard.passes.errors import BatchError
from autoshard.passes.graph import META, CapturedGraph, operands
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Replicate, Shard, Strategy, TensorMeta

from .groups import MeshEnv
from .layout import normalize

__all__ = ["DataLayout", "data_layout", "arrivals_for", "local_shapes", "user_inputs", "InputCheck"]


@dataclass(frozen=True)
class DataLayout:
    """The data-parallel axes of a plan, this rank's place along them, and which inputs are batch inputs.
    ``global_batch``: rows of a batch input in the full-batch step; ``local_batch`` those of one slice."""
    axes: tuple
    size: int
    rank: int
    batch_inputs: tuple
    global_batch: int
    other_axes: tuple

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.size


def user_inputs(captured: CapturedGraph) -> list[str]:
    """The placeholders of the user's inputs and the target (all of ``captured``'s non-state inputs)."""
    return list(captured.inputs) + ([captured.target] if captured.target is not None else [])


def _batch_inputs(captured: CapturedGraph, names: list[str]) -> tuple[list[str], int]:
    metas = [(n, captured.node(n).meta.get(META)) for n in names]
    tensors = [(n, m) for n, m in metas if isinstance(m, TensorMeta) and len(m.shape) > 0]
    if not tensors:
        return [], 0
    rows = tensors[0][1].shape[0]
    return [n for n, m in tensors if m.shape[0] == rows], rows


def _row_axes(placements, mesh: Mesh) -> set[int]:
    pls = normalize(placements, mesh.shape)
    return {a for a, p in enumerate(pls) if isinstance(p, Shard) and p.dim == 0 and mesh.shape[a] > 1}


def _read_axes(captured: CapturedGraph, strategies: dict[str, Strategy], name: str, mesh: Mesh) -> set[int]:
    """Mesh axes on which every op reading input ``name`` reads it as ``S(0)``: a rank there needs only
    its own rows of it."""
    node = captured.node(name)
    axes = {a for a in range(mesh.ndim) if mesh.shape[a] > 1}
    for user in node.users:
        if user.op == "output":
            return set()
        for i, op in enumerate(operands(user)):
            if op.node is node:
                axes &= _row_axes(strategies[user.name].inputs[i], mesh)
    return axes


def data_layout(graphs: list[tuple[CapturedGraph, dict[str, Strategy], list[str]]], mesh: Mesh, coordinate,
                *, microbatches: int = 1) -> DataLayout:
    """The ``DataLayout`` of a program made of ``graphs`` ((captured graph, its strategies, the names of
    the user inputs and target it reads): one for a plain program, one per stage for a pipeline, all on
    meshes of ``mesh``'s shape) for the rank at ``coordinate``. ``microbatches``: a pipeline's graphs
    are traced at microbatch size."""
    axes: Optional[set[int]] = None
    names: list[str] = []
    rows = 0
    for captured, strategies, inputs in graphs:
        batch, b = _batch_inputs(captured, inputs)
        for name in batch:
            got = _read_axes(captured, strategies, name, mesh)
            axes = got if axes is None else axes & got
            if name not in names:
                names.append(name)
        rows = rows or b
    chosen = tuple(sorted(axes or ()))
    size = math.prod(mesh.shape[a] for a in chosen)
    rank = 0
    for a in chosen:
        rank = rank * mesh.shape[a] + coordinate[a]
    others = tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1 and a not in chosen)
    return DataLayout(chosen, size, rank, tuple(names), rows * microbatches, others)


def arrivals_for(layout: DataLayout, ndim: int) -> dict[str, tuple]:
    """Input name -> the placements a local slice arrives in: ``S(0)`` on the data-parallel axes."""
    pls = tuple(Shard(0) if a in layout.axes else Replicate() for a in range(ndim))
    return {name: pls for name in layout.batch_inputs}


def local_shapes(captured: CapturedGraph, layout: DataLayout, microbatches: int = 1) -> dict[str, tuple]:
    """Input name -> the shape a rank passes with ``local_batch=True`` (the whole step's slice)."""
    out = {}
    for name in user_inputs(captured):
        meta = captured.node(name).meta.get(META)
        if not isinstance(meta, TensorMeta):
            continue
        shape = tuple(meta.shape)
        if name in layout.batch_inputs:
            shape = (layout.local_batch,) + shape[1:]
        elif microbatches > 1 and shape:
            shape = (shape[0] * microbatches,) + shape[1:]
        out[name] = shape
    return out


class InputCheck:
    """Checks that ranks along the non-data-parallel axes pass the same inputs: each call all-reduces
    (MAX) two checksums of every input and their negations over those axes, and raises ``BatchError``
    when some rank's differ. A no-op when every axis of size > 1 is data parallel."""

    def __init__(self, layout: DataLayout, env: MeshEnv):
        self.layout = layout
        self.comm = env.comm_for(layout.other_axes) if layout.other_axes and env.distributed else None

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.comm is None or self.comm.size == 1:
            return
        sums = []
        for _, x in named:
            flat = x.detach().reshape(-1).double()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(977)
            sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
        if not sums:
            return
        mine = torch.cat(sums)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.comm.pg())
        high, low = both[:mine.numel()], -both[mine.numel():]
        differ = [name for k, (name, _) in enumerate(named) if not torch.equal(high[2 * k:2 * k + 2],
                                                                               low[2 * k:2 * k + 2])]
        if differ:
            axes = ", ".join(f"axis {a}" for a in self.layout.other_axes)
            raise BatchError(f"with local_batch=True, ranks along {axes} (not data parallel in this plan) must pass the "
                             f"same slice, but input(s) {differ} differ between them; feed each rank the slice of its "
                             f"data_parallel_rank ({self.layout.rank} of {self.layout.size} here)")
