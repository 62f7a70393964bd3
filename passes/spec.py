"""Sharding IR: DTensor placements per mesh axis, and the strategies an op can run under.

Vocabulary (DTensor's, printed short): ``Shard(d)`` -> ``S(d)``, ``Replicate()`` -> ``R``,
``Partial()`` -> ``P`` (each rank holds a summand; the value is the sum over the axis).

A tensor's *placements* is a tuple with one ``Placement`` per mesh axis. Two axes may shard the
same tensor dim: ``(S(0), S(0))`` splits dim 0 first by axis 0, then each piece by axis 1
(DTensor's left-to-right nesting).

Gradient convention (what the runtime implements and the cost model prices): the local gradient
of a tensor placed ``R`` on an axis is a *summand* of the true gradient (i.e. it is ``P``); of
``P`` it is the full gradient (``R``); of ``S(d)`` it is the matching shard (``S(d)``). So a
replicated parameter's gradient needs an all-reduce over every axis where it is ``R``, and every
collective's backward is its adjoint (all-gather <-> reduce-scatter, all-reduce <-> all-reduce,
local chunk <-> zero-pad, all-to-all <-> all-to-all).

A sharding rule returns ``Strategy1D`` options for ONE mesh axis. ``passes.sharding.strategies`` combines
them into multi-axis ``Strategy`` objects (the product over axes, filtered by divisibility).

Local semantics of a strategy: every rank runs the same ATen op on its local pieces, with
size-like arguments (view/reshape/expand/new_* sizes) replaced by the local sizes, unless
``lowering`` names a special local lowering (``passes/cost/lowerings.py`` registers one descriptor
per name, the runtime an emitter under the same name; for example ``"mean_partial"``: a mean over
a sharded dim computed as a local sum divided by the global count, output ``P``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "Shard", "Replicate", "Partial", "Placement", "Placements", "R", "P", "S",
    "fmt", "fmt_placements", "placement_to_json", "placement_from_json", "parse_placement",
    "Strategy1D", "Strategy", "TensorMeta",
]

Placements = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def fmt(p: Placement) -> str:
    """Short form: ``S(0)``, ``R``, ``P``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P"
    raise TypeError(f"not a placement: {p!r}")


def fmt_placements(pls: Optional[Sequence[Placement]]) -> str:
    if pls is None:
        return "-"
    return "(" + ", ".join(fmt(p) for p in pls) + ")"


def placement_to_json(p: Placement) -> str:
    return fmt(p)


def parse_placement(text: str) -> Placement:
    """Inverse of ``fmt``: ``"S(1)"`` -> ``Shard(1)``; also accepts ``"Shard(1)"``, ``"Replicate()"``."""
    t = text.strip().replace(" ", "")
    if t in ("R", "Replicate()", "Replicate"):
        return Replicate()
    if t in ("P", "Partial()", "Partial"):
        return Partial()
    for prefix in ("S(", "Shard("):
        if t.startswith(prefix) and t.endswith(")"):
            return Shard(int(t[len(prefix):-1]))
    raise ValueError(f"cannot parse placement {text!r}: expected S(d), R or P")


placement_from_json = parse_placement


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor value in the captured graph."""
    shape: tuple[int, ...]
    dtype: "torch.dtype"  # noqa: F821

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (complex dtypes count both parts: complex64 is 8 bytes)."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Strategy1D:
    """How an op may run along one mesh axis.

    ``inputs``: one entry per tensor operand (see ``passes.graph.operands``), the placement the op
    needs that operand in; ``outputs``: one placement per tensor output; ``lowering``: name of a
    special local lowering (None: run the ATen op as is on local pieces).
    """
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    lowering: Optional[str] = None

    def __str__(self) -> str:
        s = f"{fmt_placements(self.inputs)}->{fmt_placements(self.outputs)}"
        return s + (f"[{self.lowering}]" if self.lowering else "")


@dataclass(frozen=True)
class Strategy:
    """How an op runs on the whole mesh: placements per operand and output, per mesh axis.

    ``inputs[i][a]`` is operand i's placement on mesh axis a; ``outputs[j][a]`` likewise;
    ``lowerings[a]`` is the 1-D lowering used on axis a (None for plain local execution).
    """
    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    lowerings: tuple[Optional[str], ...] = field(default=())

    def __str__(self) -> str:
        ins = ",".join(fmt_placements(p) for p in self.inputs)
        outs = ",".join(fmt_placements(p) for p in self.outputs)
        low = [l for l in self.lowerings if l]
        return f"[{ins}]->[{outs}]" + (f"{{{','.join(low)}}}" if low else "")

    def to_json(self) -> dict:
        return {
            "inputs": [[fmt(p) for p in pls] for pls in self.inputs],
            "outputs": [[fmt(p) for p in pls] for pls in self.outputs],
            "lowerings": list(self.lowerings),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Strategy":
        return cls(
            tuple(tuple(parse_placement(p) for p in pls) for pls in data["inputs"]),
            tuple(tuple(parse_placement(p) for p in pls) for pls in data["outputs"]),
            tuple(data.get("lowerings", ())),
        )
