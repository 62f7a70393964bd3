"""The default plan picture: one box per module segment, repeated blocks folded, readable at a glance.

``block_plan_to_dot(plan)`` draws any plan: a plan of one stage as its boxes, a pipelined one as one
cluster per stage with consecutive identical stages folded ("stages 1-14, x14"). Each box
(``segments.DrawnUnit``) lists the parameters its ops read with their shape and storage placement
per mesh axis (coloured as the op-level drawing colours values), the collectives inside it (per
block instance) and its gradient syncs; a folded block says "xN" and carries the collectives
between two consecutive instances on a loop. An edge between boxes carries the collectives on it
(kind, mesh axis, bytes per step, estimated time). The title gives the step time, memory per
device, tokens (or samples) per second per device and MFU; a legend explains colours and notation.
The op-level graph is ``plan_graph`` (``render(path, detail="ops")``).
"""
from __future__ import annotations

import html

from autoshard.drawing.dot import axes_label, escape, placement_colour
from autoshard.drawing.segments import (DrawnUnit, Traffic, fold, segments, traffic, unit_params, unit_signature,
                                        value_bytes)
from autoshard.passes.cost.collectives import axis_label
from autoshard.passes.graph import META
from autoshard.passes.solve.clustering import OUTPUT
from autoshard.passes.units import human_bytes, human_time

__all__ = ["block_plan_to_dot"]

_HEADER = "#dbe4ee"
_KIND = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
         "all_to_all": "all-to-all"}


def _h(text) -> str:
    return html.escape(str(text), quote=True)


def _shape(meta) -> str:
    return "\u00d7".join(str(d) for d in meta.shape) if meta is not None and meta.shape else "scalar"


def _collective_lines(table: dict, axis_names, suffix: str = "", phases: bool = True) -> list[str]:
    """One line per (kind, mesh axis): count, bytes and time; a forward collective and the backward
    adjoint with the same count and bytes (all-gather / reduce-scatter) share one line."""
    def head(kind, axis, s):
        times = f" \u00d7{s.count:.3g}" if abs(s.count - 1) > 1e-9 else ""
        return f"{_KIND.get(kind, kind)}({axis_label(axis, axis_names)}){times}"

    rows = sorted(table.items(), key=lambda kv: (kv[0][0] != "fwd", -kv[1].seconds, kv[0][:2], str(kv[0][2])))
    used, lines = set(), []
    for key, s in rows:
        if key in used:
            continue
        used.add(key)
        phase, kind, axis = key
        if not phases:
            lines.append(f"{head(kind, axis, s)}: {human_bytes(s.bytes)}, {human_time(s.seconds)}{suffix}")
            continue
        twin = next((k for k, t in rows if k not in used and k[0] != phase and k[2] == axis
                     and abs(t.count - s.count) < 1e-9 and abs(t.bytes - s.bytes) <= 1e-6 * max(1.0, s.bytes)), None)
        if twin is not None:
            used.add(twin)
            lines.append(f"{head(kind, axis, s)}, bwd {_KIND.get(twin[1], twin[1])}: {human_bytes(s.bytes)}, "
                         f"{human_time(s.seconds)} each way{suffix}")
        else:
            lines.append(f"{phase} {head(kind, axis, s)}: {human_bytes(s.bytes)}, {human_time(s.seconds)}{suffix}")
    return lines


def _title(plan, head: str) -> str:
    parts = [head, f"est. step {human_time(plan.estimated_step_time)}",
             f"memory {human_bytes(plan.estimated_memory)} per device"]
    work = getattr(plan, "work", None)
    if work is not None and plan.estimated_step_time:
        parts.append(f"{work.rate(plan.estimated_step_time):,.4g} {work.rate_unit}/s per device")
        parts.append(f"MFU {100 * work.mfu(plan.estimated_step_time):.1f}%")
    return "  |  ".join(parts)


def _unit_label(unit: DrawnUnit, u: int, solution, captured, axis_names, moves: Traffic) -> str:
    strategies = solution.strategies
    n_ops = len(unit.segments[0].nodes)
    per = " per block" if unit.count > 1 else ""
    also = ", ".join(k or "top level" for k in unit.segments[0].also)
    ops = f"{n_ops} ops{' each' if unit.count > 1 else ''}" + (f", with the glue of {also}" if also else "")
    head = (f"<B>{_h(unit.label)}</B>" + (f"  \u00d7{unit.count}" if unit.count > 1 else "")
            + f'  <FONT POINT-SIZE="9">({_h(ops)})</FONT>')
    rows = [f'<TR><TD COLSPAN="3" BGCOLOR="{_HEADER}">{head}</TD></TR>']
    prefix = unit.segments[0].key if unit.block is not None else ""
    for p in unit_params(captured, unit.segments[0].nodes):
        fqn = captured.params[p]
        name = fqn[len(prefix) + 1:] if prefix and fqn.startswith(prefix + ".") else fqn
        pls = strategies[p].outputs[0] if p in strategies else ()
        rows.append(f'<TR><TD ALIGN="LEFT">{_h(name)}</TD><TD>{_h(_shape(captured.node(p).meta.get(META)))}</TD>'
                    f'<TD BGCOLOR="{placement_colour(pls)}">{_h(axes_label(pls, axis_names))}</TD></TR>')
    notes = _collective_lines(moves.inside.get(u, {}), axis_names, per)
    grads = _collective_lines(moves.grad_sync.get(u, {}), axis_names, "", False)
    if grads:
        notes.append("grad sync" + per + ": " + "; ".join(grads))
    rows += [f'<TR><TD COLSPAN="3" ALIGN="LEFT">{_h(line)}</TD></TR>' for line in notes]
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">' + "".join(rows) + "</TABLE>>"


def _legend(axis_names, pipelined: bool = False) -> str:
    rows = ['<TR><TD COLSPAN="2" BGCOLOR="#eeeeee"><B>legend</B></TD></TR>']
    for colour, text in ((placement_colour(()), "replicated on every axis (R)"),
                         ("#c6dbef", "sharded on some axis (S(d): split along dim d)"),
                         ("#fdd9a0", "partial on some axis (P: a sum still to reduce)")):
        rows.append(f'<TR><TD BGCOLOR="{colour}" WIDTH="24"> </TD><TD ALIGN="LEFT">{_h(text)}</TD></TR>')
    for text in (f"placements per mesh axis: {', '.join(f'{a}:...' for a in axis_names)}",
                 "\u00d7N: N identical blocks drawn once (figures per block)",
                 "edges: collectives on the way (bytes, est. time per step)",
                 "\"x, bwd y\": forward collective x, its backward adjoint y") + (
                    ("stages: their plans priced at the global batch in one pass",) if pipelined else ()):
        rows.append(f'<TR><TD COLSPAN="2" ALIGN="LEFT">{_h(text)}</TD></TR>')
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"


def _header_lines(title: str) -> list[str]:
    return ["digraph autoshard_blocks {",
            f'  graph [rankdir=TB, fontname="Helvetica", fontsize=13, labelloc=t, nodesep=0.3, ranksep=0.2, '
            f'label="{escape(title)}"];',
            '  node [fontname="Helvetica", fontsize=10, shape=plaintext];',
            '  edge [fontname="Helvetica", fontsize=9, color="#606060"];']


def _units_and_edges(prefix: str, units, solution, captured, axis_names) -> tuple[list[str], list[str]]:
    """Box lines and edge lines of one program's units (a plan, or one pipeline stage)."""
    moves = traffic(units, solution, captured)
    boxes, edges = [], []
    for u, unit in enumerate(units):
        boxes.append(f'"{prefix}u{u}" [label={_unit_label(unit, u, solution, captured, axis_names, moves)}];')
        between = _collective_lines(moves.between.get(u, {}), axis_names)
        if unit.count > 1 and between:
            text = escape("\n".join(["block to next block:"] + between))
            edges.append(f'"{prefix}u{u}" -> "{prefix}u{u}" [label="{text}", color="#de2d26", fontcolor="#de2d26"];')
    entry = set(captured.inputs) | ({captured.target} if captured.target else set())
    for src, dst in sorted(moves.links, key=str):
        if isinstance(src, str) and src not in entry:
            continue  # a value received from an earlier pipeline stage: drawn as the stage-to-stage edge
        a = f"in_{src}" if isinstance(src, str) else f"{prefix}u{src}"
        b = "out" if dst == OUTPUT else f"{prefix}u{dst}"
        lines = _collective_lines(moves.edges.get((src, dst), {}), axis_names)
        style = ', color="#de2d26", fontcolor="#de2d26", penwidth=1.5' if lines else ""
        edges.append(f'"{a}" -> "{b}" [label="{escape(chr(10).join(lines))}"{style}];')
    return boxes, edges


def _input_boxes(captured, strategies_of, axis_names) -> list[str]:
    out = []
    for name in list(captured.inputs) + ([captured.target] if captured.target else []):
        meta = captured.node(name).meta.get(META)
        strategies = strategies_of(name)
        pls = strategies[name].outputs[0] if name in strategies and strategies[name].outputs else ()
        what = name if name != captured.target or name == "target" else f"target {name}"
        text = f"{what} [{_shape(meta)} {str(getattr(meta, 'dtype', '')).replace('torch.', '')}]"
        out.append(f'"in_{name}" [shape=box, style="filled,rounded", height=0.3, fillcolor="{placement_colour(pls)}", '
                   f'label="{escape(text + chr(10) + axes_label(pls, axis_names))}"];')
    return out


def block_plan_to_dot(plan) -> str:
    """Block-level graphviz dot text for a ``Plan`` carrying its captured graph (module docstring): its
    stages drawn only when it has several (``_stages_to_dot``)."""
    if plan.captured is None:
        raise ValueError("this plan has no captured graph (it was loaded from JSON): compile or plan it "
                         "against the model first, e.g. load_plan(p).attach(capture(...), mesh)")
    if plan.pipelined:
        return _stages_to_dot(plan)
    captured, sol, names = plan.captured, plan.solution, plan.mesh.axis_names
    units = fold(segments(captured), sol, captured)
    head = f"autoshard plan: mesh {plan.mesh.shape} {tuple(names)}, {plan.hardware}"
    lines = _header_lines(_title(plan, head))
    lines += ["  " + x for x in _input_boxes(captured, lambda name: sol.strategies, names)]
    boxes, edges = _units_and_edges("", units, sol, captured, names)
    lines += ["  " + x for x in boxes]
    lines.append("  " + _output_box(captured))
    lines += ["  " + x for x in edges]
    lines.append(f'  "legend" [label={_legend(names)}];')
    tallest = max(range(len(units)), key=lambda u: len(unit_params(captured, units[u].segments[0].nodes)))
    lines.append(f'  {{ rank=same; "u{tallest}"; "legend"; }}')  # beside the biggest box, not above the inputs
    lines.append("}")
    return "\n".join(lines) + "\n"


def _output_box(captured) -> str:
    return (f'"out" [shape=ellipse, style=filled, fillcolor="#e5f5e0", height=0.3, '
            f'label="{"loss" if captured.loss_output else "output"}"];')


def _ranks(ranks) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))


def _span(values) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 and values[0] != values[-1] else f"{values[0]}"


def _cut_bytes(captured, stage_of: dict, boundary: int) -> float:
    """Bytes of the values made in stages <= ``boundary`` and read in later stages (global batch)."""
    total = 0.0
    for node in captured.gm.graph.nodes:
        s = stage_of.get(node.name)
        if s is None or s > boundary:
            continue
        later = [u for u in node.users if (stage_of.get(u.name, len(stage_of)) if u.op == "output"
                                           else stage_of.get(u.name, -1)) > boundary]
        if later:
            total += value_bytes(captured, node.name)
    return total


def _stages_to_dot(plan) -> str:
    """A pipelined plan: one cluster per stage (consecutive identical stages folded), each drawn as a
    plan of one stage is drawn."""
    captured, pipe, mesh = plan.captured, plan, plan.mesh
    stage_units = [fold(segments(captured, st.nodes), st.solution, captured) for st in pipe.stages]
    stage_of = {n: st.index for st in pipe.stages for n in st.nodes}
    runs: list[tuple[list[int], tuple]] = []
    for s, st in enumerate(pipe.stages):
        sig = (tuple(st.mesh.shape), st.recompute,
               tuple((u.block or u.label, u.count, unit_signature(u.segments[0], st.solution, captured))
                     for u in stage_units[s]))
        if runs and runs[-1][1] == sig and pipe.stages[runs[-1][0][-1]].group != st.group:
            runs[-1][0].append(s)
        else:
            runs.append(([s], sig))
    head = (f"autoshard pipelined plan: mesh {mesh.shape} {tuple(mesh.axis_names)}, {plan.hardware}, "
            f"pp {pipe.pp} x {pipe.virtual}, {pipe.schedule}, {pipe.microbatches} microbatches")
    lines = _header_lines(_title(plan, head))
    lines[1] = lines[1].replace("rankdir=TB,", "rankdir=TB, compound=true,")

    def strategies_of(name):
        return next((st.solution.strategies for st in pipe.stages
                     if st.solution is not None and name in st.solution.strategies), {})

    sub_names = pipe.stages[0].mesh.axis_names
    lines += ["  " + x for x in _input_boxes(captured, strategies_of, sub_names)]
    lines.append("  " + _output_box(captured))
    edges: list[str] = []
    firsts, lasts = [], []
    for r, (members, _) in enumerate(runs):
        s0 = members[0]
        st = pipe.stages[s0]
        prefix = f"s{s0}_"
        boxes, inner = _units_and_edges(prefix, stage_units[s0], st.solution, captured, st.mesh.axis_names)
        mems = [pipe.stages[s].solution.estimated_memory for s in members if pipe.stages[s].solution is not None]
        ranks = [rk for s in members for rk in pipe.stages[s].ranks]
        fold_note = f" (\u00d7{len(members)})" if len(members) > 1 else ""
        parts = [f"stage{'s' if len(members) > 1 else ''} {_span(members)}{fold_note}",
                 f"group{'s' if len(members) > 1 else ''} {_span([pipe.stages[s].group for s in members])}",
                 f"ranks {_ranks(sorted(ranks))}", f"submesh {tuple(st.mesh.shape)} {tuple(st.mesh.axis_names)}"]
        if st.recompute:
            parts.append("recomputes activations")
        if mems:
            lo, hi = human_bytes(min(mems)), human_bytes(max(mems))
            parts.append(f"est. memory {lo if lo == hi else lo + ' - ' + hi} per device")
        if len(members) > 1:
            parts.append(f"p2p to the next stage {human_bytes(_cut_bytes(captured, stage_of, s0) / pipe.microbatches)} "
                         "per microbatch")
        label = escape(" | ".join(parts[:3]) + "\n" + " | ".join(parts[3:]))
        lines.append(f'  subgraph cluster_{r} {{ label="{label}"; style="rounded"; color="#3182bd"; fontsize=11;')
        lines += ["    " + b for b in boxes]
        lines.append("  }")
        edges += inner
        firsts.append(f"{prefix}u0")
        lasts.append(f"{prefix}u{len(stage_units[s0]) - 1}")
    for r in range(len(runs) - 1):
        boundary = runs[r][0][-1]
        same = pipe.stages[boundary].group == pipe.stages[boundary + 1].group
        what = "local hand-off" if same else "p2p"
        text = f"{what} {human_bytes(_cut_bytes(captured, stage_of, boundary) / pipe.microbatches)} per microbatch"
        edges.append(f'"{lasts[r]}" -> "{firsts[r + 1]}" [ltail=cluster_{r}, lhead=cluster_{r + 1}, '
                     f'label="{escape(text)}", color="#3182bd", fontcolor="#3182bd", penwidth=2];')
    lines += ["  " + e for e in edges]
    lines.append(f'  "legend" [label={_legend(sub_names, pipelined=True)}];')
    lines.append("}")
    return "\n".join(lines) + "\n"
