"""A program at block level: its ops cut into module segments, repeated blocks folded, collectives
assigned to the segment they sit in or the edge between two.

- ``segments(captured, nodes)``: consecutive ops of one module form a segment. An op inside a
  numbered block belongs to the block instance (``transformer.h.3``); any other op to its module
  path cut at the depth of the block container's children (``transformer.wte``, ``lm_head``), or to
  the top level ("": the loss and glue). A segment outside blocks that reads no parameter (glue:
  position ids, masks, the loss) joins the segment outside blocks before it, or else the next one.
- ``fold(segments, solution, captured)``: consecutive instances of one block type whose strategies,
  parameter placements and inner collectives are equal become one ``DrawnUnit`` with ``count``.
- ``traffic(units, solution, captured)``: every redistribution of ``solution`` is inside a unit
  (per instance), between two folded instances of one unit, or on the edge between two units; and
  each unit's gradient syncs.

Plain data for ``block_graph`` to draw; nothing here writes dot text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from autoshard.drawing.dot import op_name
from autoshard.passes.graph import CapturedGraph, outputs
from autoshard.passes.solve.clustering import OUTPUT, block_instance, module_path
from autoshard.passes.spec import fmt_placements

__all__ = ["Segment", "DrawnUnit", "Traffic", "segments", "fold", "traffic", "unit_params", "unit_signature",
           "CollectiveSum", "value_bytes"]


@dataclass
class Segment:
    """Consecutive ops of one module: ``key`` (block instance or module path, "" for the top level),
    ``block`` (the normalized block path for a block instance, else None), op ``nodes``, and the
    modules whose glue joined it (``also``)."""
    key: str
    block: Optional[str]
    nodes: list[str] = field(default_factory=list)
    #: other modules whose glue ops joined this segment ("" for the top level)
    also: list[str] = field(default_factory=list)


@dataclass
class DrawnUnit:
    """One drawn box: ``segments`` (several when repeated blocks fold), ``count`` instances, ``label``
    ("transformer.h.0-95" or the module path)."""
    segments: list[Segment]
    label: str

    @property
    def count(self) -> int:
        return len(self.segments)

    @property
    def block(self) -> Optional[str]:
        return self.segments[0].block

    @property
    def nodes(self) -> list[str]:
        return [n for s in self.segments for n in s.nodes]


@dataclass
class CollectiveSum:
    """Collectives of one (phase, kind, axis): how many, total bytes and seconds."""
    count: float = 0
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class Traffic:
    """``inside[u]``: collectives inside unit u per instance; ``between[u]``: between two consecutive
    folded instances of u (per pair); ``edges[(a, b)]``: from unit a (or an input's name) to unit b
    (or OUTPUT); ``grad_sync[u]``: gradient syncs per instance. Each maps (phase, kind, axis) -> sum."""
    inside: dict[int, dict] = field(default_factory=dict)
    between: dict[int, dict] = field(default_factory=dict)
    edges: dict[tuple, dict] = field(default_factory=dict)
    grad_sync: dict[int, dict] = field(default_factory=dict)
    links: set = field(default_factory=set)


def _key(path: Optional[str], depth: int) -> tuple[str, Optional[str]]:
    inst = block_instance(path)
    if inst is not None:
        return inst[1], inst[0]
    return (".".join(path.split(".")[:depth]) if path else ""), None


def segments(captured: CapturedGraph, nodes: Optional[Iterable[str]] = None) -> list[Segment]:
    """The call_function ops of ``captured`` (only ``nodes`` if given) as module segments (module docstring)."""
    wanted = None if nodes is None else set(nodes)
    ops = [n for n in captured.gm.graph.nodes if n.op == "call_function" and (wanted is None or n.name in wanted)]
    paths = {n.name: module_path(n, captured) for n in ops}
    containers = {block_instance(p)[0] for p in paths.values() if block_instance(p) is not None}
    depth = 1 + min((c.count(".") for c in containers), default=0)
    out: list[Segment] = []
    for n in ops:
        key, block = _key(paths[n.name], depth)
        if out and out[-1].key == key:
            out[-1].nodes.append(n.name)
        else:
            out.append(Segment(key, block, [n.name]))
    # glue (a segment outside blocks reading no parameter: position ids, masks, the loss) joins the
    # segment outside blocks before it, or else the one after it; blocks stay whole so they fold
    merged: list[Segment] = []
    pending: list[Segment] = []
    for seg in out:
        glue = seg.block is None and not unit_params(captured, seg.nodes)
        if glue and merged and merged[-1].block is None:
            _join(merged[-1], seg)
        elif glue:
            pending.append(seg)
        elif seg.block is None:
            for g in pending:
                _join(seg, g, before=True)
            pending = []
            if merged and merged[-1].key == seg.key:
                _join(merged[-1], seg)
            else:
                merged.append(seg)
        else:
            merged.extend(pending)
            pending = []
            merged.append(seg)
    merged.extend(pending)
    return merged


def _join(into: Segment, seg: Segment, before: bool = False) -> None:
    into.nodes = seg.nodes + into.nodes if before else into.nodes + seg.nodes
    for key in [seg.key] + seg.also:
        if key != into.key and key not in into.also:
            into.also.append(key)


def unit_params(captured: CapturedGraph, nodes: Iterable[str]) -> list[str]:
    """Parameter placeholders the ops ``nodes`` read, in first-read order."""
    found: dict[str, None] = {}
    for name in nodes:
        for a in captured.node(name).all_input_nodes:
            if a.name in captured.params:
                found.setdefault(a.name, None)
    return list(found)


def _relative(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name


def unit_signature(seg: Segment, solution, captured: CapturedGraph) -> tuple:
    """What must match for two segments to be drawn as one: per-position strategies and op names,
    parameter placements by name relative to the block, and the collectives inside."""
    strategies = solution.strategies
    rows = [str(strategies.get(n)) for n in seg.nodes]
    rows += [(_relative(captured.params[p], seg.key), fmt_placements(strategies[p].outputs[0]))
             for p in unit_params(captured, seg.nodes) if p in strategies]
    mine = set(seg.nodes)
    position = {n: i for i, n in enumerate(seg.nodes)}
    moves = sorted((position[r.consumer], r.operand_index, tuple(str(c) for c in r.collectives))
                   for r in solution.redistributions if r.consumer in mine and r.producer in mine)
    return tuple(rows), tuple(moves), tuple(op_name(captured.node(n)) for n in seg.nodes)


def _span_label(segs: list[Segment]) -> str:
    if segs[0].block is None:
        return segs[0].key or "(top level)"
    first, last = segs[0].key.rsplit(".", 1)[1], segs[-1].key.rsplit(".", 1)[1]
    return segs[0].block.replace("#", first if first == last else f"{first}-{last}")


def fold(segs: list[Segment], solution, captured: CapturedGraph) -> list[DrawnUnit]:
    """Consecutive equal instances of one block type as one ``DrawnUnit`` (module docstring)."""
    units: list[DrawnUnit] = []
    last_sig = None
    for seg in segs:
        sig = unit_signature(seg, solution, captured) if seg.block is not None else None
        if units and seg.block is not None and units[-1].block == seg.block and sig == last_sig:
            units[-1].segments.append(seg)
        else:
            units.append(DrawnUnit([seg], ""))
        last_sig = sig
    for u in units:
        u.label = _span_label(u.segments)
    return units


def _add(table: dict, c, scale: float = 1.0) -> None:
    s = table.setdefault((c.phase, c.kind, c.axis), CollectiveSum())
    s.count += scale
    s.bytes += c.bytes * scale
    s.seconds += c.seconds * scale


def traffic(units: list[DrawnUnit], solution, captured: CapturedGraph) -> Traffic:
    """Where ``solution``'s collectives sit among ``units`` (module docstring). Values read from
    outside the units (a previous pipeline stage, a user input) come from their own name."""
    where: dict[str, tuple[int, int]] = {}
    for u, unit in enumerate(units):
        for k, seg in enumerate(unit.segments):
            for n in seg.nodes:
                where[n] = (u, k)
    out = Traffic()
    for r in solution.redistributions:
        if r.consumer != OUTPUT and r.consumer not in where:
            continue
        dst = where.get(r.consumer)
        src = where.get(r.producer)
        if src is None and r.producer in captured.params and dst is not None:
            src = dst  # a parameter is read where its unit stores it
        per = units[dst[0]].count if dst is not None else 1
        if dst is not None and src is not None and src[0] == dst[0]:
            table = out.inside if src[1] == dst[1] else out.between
            gaps = per if src[1] == dst[1] else max(1, per - 1)
            for c in r.collectives:
                _add(table.setdefault(dst[0], {}), c, 1.0 / gaps)
        else:
            edge = (src[0] if src is not None else r.producer, dst[0] if dst is not None else OUTPUT)
            for c in r.collectives:
                _add(out.edges.setdefault(edge, {}), c)
    fqn_unit: dict[str, int] = {}
    for u, unit in enumerate(units):
        for p in unit_params(captured, unit.nodes):
            fqn_unit.setdefault(captured.params[p], u)
    for fqn, syncs in solution.param_grad_syncs.items():
        u = fqn_unit.get(fqn)
        if u is None:
            continue
        for c in syncs:
            _add(out.grad_sync.setdefault(u, {}), c, 1.0 / units[u].count)
    for node in captured.gm.graph.nodes:
        if node.op == "output" or node.name in where:
            dst = OUTPUT if node.op == "output" else where[node.name][0]
            for a in node.all_input_nodes:
                if a.op == "placeholder" and (a.name in captured.params or a.name in captured.buffers):
                    continue
                src = where[a.name][0] if a.name in where else a.name
                if src != dst:
                    out.links.add((src, dst))
    return out


def value_bytes(captured: CapturedGraph, name: str) -> float:
    """Bytes of the value node ``name`` produces (all its tensor outputs)."""
    return float(sum(m.nbytes for m in outputs(captured.node(name)) if m is not None))
