"""Layer units for a program without numbered blocks: stage-cut candidates read off the op graph.

A pipeline stage boundary may fall between any two ops (graph order is a topological order) where
everything live across it is a single tensor: the values made before the boundary and read after
it. The stage planner then pays, at that boundary, the bytes of that live set (sent forward, their
gradients back). ``cut_points`` lists every boundary with its live bytes and whether a stage may
start there; ``op_graph_units`` keeps at most ``max_units - 1`` of them and cuts the ops into
contiguous units between them:

1. every valid boundary when there are few enough;
2. otherwise first the boundaries where the live set is locally smallest (no more than at the valid
   boundaries on either side: after a residual add, before a long skip opens), chosen by compute
   quantile so the units carry about equal work; the rest of the budget, if any, from the other
   valid boundaries by the same quantiles.

A long skip (U-Net) keeps its tensor live across every boundary it spans, so the boundaries inside
it cost more and the stage ILP, which prices each cut's bytes, avoids them unless balance pays;
a skip crossing several stages goes straight from its producer's stage to its consumer's
(``passes.pipeline.stages.stage_graphs``).

A boundary is refused when it would separate a multi-output op from the ``getitem`` reading it, or
when a non-tensor value (a tuple, a symbolic size) would cross it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.fx as fx

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.solve.context import DEFAULT_HARDWARE
from autoshard.passes.graph import META, MODULE, CapturedGraph, is_getitem
from autoshard.passes.spec import TensorMeta

__all__ = ["CutPoint", "MAX_UNITS", "cut_points", "op_graph_units"]

#: units an op-graph program is cut into at most: the stage ILP's size grows with them, and 24 leave
#: room for 8 pipeline groups x 2 virtual stages with a choice of where each starts
MAX_UNITS = 24


@dataclass(frozen=True)
class CutPoint:
    """The boundary before op ``index`` (0-based among the call_function ops; 1..n-1): the bytes
    (global shapes) of the values live across it, and ``refused``: why no stage may start there
    (None when one may)."""
    index: int
    node: str
    live_bytes: int
    refused: Optional[str] = None


def _ops(captured: CapturedGraph) -> list[fx.Node]:
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"]


def cut_points(captured: CapturedGraph) -> list[CutPoint]:
    """Every boundary between two consecutive ops, with its live bytes and validity (module docstring)."""
    ops = _ops(captured)
    pos = {n: i for i, n in enumerate(ops)}
    end = len(ops)
    last_read: dict[fx.Node, int] = {}
    for n in ops:
        for user in n.users:
            last_read[n] = max(last_read.get(n, -1), pos.get(user, end))
    opened: list[list[fx.Node]] = [[] for _ in range(end + 1)]
    closed: list[list[fx.Node]] = [[] for _ in range(end + 1)]
    for n, last in last_read.items():
        if last > pos[n]:
            opened[pos[n] + 1].append(n)
            closed[last + 1 if last < end else end].append(n)
    live: set[fx.Node] = set()
    out = []
    for i in range(1, end):
        live.update(opened[i])
        live.difference_update(closed[i])
        refused = None
        if is_getitem(ops[i]):
            refused = f"{ops[i].name} reads an output of a multi-output op, which stays on its stage"
        else:
            bad = next((v for v in live if not isinstance(v.meta.get(META), TensorMeta)), None)
            if bad is not None:
                refused = f"{bad.name} would cross it and is no single tensor"
        size = sum(v.meta[META].nbytes for v in live if isinstance(v.meta.get(META), TensorMeta))
        out.append(CutPoint(i, ops[i].name, int(size), refused))
    return out


def _local_minima(valid: list[CutPoint]) -> list[CutPoint]:
    keep = []
    for k, c in enumerate(valid):
        before = valid[k - 1].live_bytes if k > 0 else float("inf")
        after = valid[k + 1].live_bytes if k + 1 < len(valid) else float("inf")
        if c.live_bytes <= before and c.live_bytes <= after:
            keep.append(c)
    return keep


def _by_quantile(pool: list[CutPoint], want: int, share: dict[int, float], taken: set[int]) -> list[int]:
    """Up to ``want`` boundaries of ``pool`` (not in ``taken``) nearest to even compute quantiles,
    fewer live bytes breaking ties."""
    chosen: list[int] = []
    free = [c for c in pool if c.index not in taken]
    for j in range(1, want + 1):
        if not free:
            break
        target = j / (want + 1)
        best = min(free, key=lambda c: (abs(share[c.index] - target), c.live_bytes, c.index))
        chosen.append(best.index)
        free.remove(best)
    return chosen


def op_graph_units(captured: CapturedGraph, max_units: int = MAX_UNITS,
                   keep: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """The program's ops cut into at most ``max_units`` contiguous units at valid boundaries
    (module docstring), as (name, node names); a unit is named after its first op's module and
    node ("d2:conv1d_1"), or the node alone outside modules. ``keep``: ops that must start a unit
    (pinned stage boundaries; they count towards ``max_units`` and need not be valid: splitting the
    program there reports what crosses)."""
    ops = _ops(captured)
    if not ops:
        return []
    index = {n.name: i for i, n in enumerate(ops)}
    pinned = sorted({index[k] for k in keep if k in index and index[k] > 0})
    valid = [c for c in cut_points(captured) if c.refused is None and c.index not in pinned]
    if len(valid) + len(pinned) + 1 <= max_units:
        starts = sorted([c.index for c in valid] + pinned)
    else:
        facts = GraphFacts(captured, PRESETS[DEFAULT_HARDWARE])  # ranks ops by work: any preset's FLOP rates
        work = [sum(facts.compute(n.name)) for n in ops]
        total = sum(work) or 1.0
        before, acc = {}, 0.0
        for i, w in enumerate(work):
            before[i] = acc / total
            acc += w
        budget = max(0, max_units - 1 - len(pinned))
        minima = _local_minima(valid)
        starts = _by_quantile(minima, budget, before, set())
        starts += _by_quantile(valid, budget - len(starts), before, set(starts))
        starts = sorted(starts + pinned)
    bounds = [0] + starts + [len(ops)]
    units = []
    for a, b in zip(bounds, bounds[1:]):
        first = ops[a]
        module = first.meta.get(MODULE) or ""
        units.append((f"{module}:{first.name}" if module else first.name, [n.name for n in ops[a:b]]))
    return units
