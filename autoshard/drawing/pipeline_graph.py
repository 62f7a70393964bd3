"""Draw a pipeline plan's partition with graphviz: one cluster per stage.

Each stage's cluster is labelled with its index, rank group, ranks, logical submesh (and whether it
recomputes activations), and, for every stage after the first, the cut in front of it: the op (and
its module) the stage starts at and the values it receives, from which stages; inside it every op is a box with its output placement per submesh axis
from that stage's intra-op plan, parameters and inputs are ellipses. An edge between ops of two
stages is a point-to-point transfer (red, labelled ``p2p``); a value that skips stages is drawn
straight from its producer's stage to its consumer's, as the runtime sends it.
"""
from __future__ import annotations

from autoshard.drawing.dot import axes_label, escape, is_view_op, op_name, placement_colour
from autoshard.passes.graph import MODULE, outputs
from autoshard.passes.units import human_bytes, human_time

__all__ = ["pipeline_to_dot"]


def pipeline_to_dot(plan, captured) -> str:
    """Graphviz dot text for the pipelined ``Plan`` ``plan`` over ``captured`` (the program it was cut from)."""
    stage_of = {name: s.index for s in plan.stages for name in s.nodes}
    stage_by_index = {s.index: s for s in plan.stages}
    param_of = captured.params
    inputs = set(captured.inputs) | ({captured.target} if captured.target else set())
    nodes = [n for n in captured.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    consumers: dict[str, set] = {}
    for n in nodes:
        for src in n.all_input_nodes:
            if n.name in stage_of:
                consumers.setdefault(src.name, set()).add(stage_of[n.name])
    for n in nodes:  # placeholders live with their first consumer's stage
        if n.op == "placeholder" and n.name not in stage_of and consumers.get(n.name):
            stage_of[n.name] = min(consumers[n.name])

    est = f", est. step {human_time(plan.estimated_step_time)}" if plan.estimated_step_time else ""
    lines = ["digraph autoshard_pipeline {",
             '  graph [rankdir=TB, fontname="Helvetica", fontsize=11, labelloc=t, '
             f'label="autoshard pipeline: pp {plan.pp} x {plan.virtual} virtual, {plan.schedule}, '
             f'{plan.microbatches} microbatches{est}"];',
             '  node [fontname="Helvetica", fontsize=9, style=filled];',
             '  edge [fontname="Helvetica", fontsize=8, color="#606060"];']
    members: dict[int, list[str]] = {s.index: [] for s in plan.stages}
    for n in nodes:
        s = stage_of.get(n.name)
        if s is None:
            continue
        stage = stage_by_index[s]
        names = stage.mesh.axis_names
        strat = stage.solution.strategies.get(n.name) if stage.solution is not None else None
        pls = strat.outputs[0] if strat is not None and strat.outputs else ()
        placement = axes_label(pls, names) if pls else "-"
        metas = [m for m in outputs(n) if m is not None]
        shape = "x".join(str(d) for d in metas[0].shape) if metas else ""
        if n.op == "placeholder":
            what = param_of.get(n.name) or (f"input {n.name}" if n.name in inputs else
                                             f"buffer {captured.buffers.get(n.name, n.name)}")
            label, kind = f"{what}\n[{shape}]\n{placement}", "ellipse"
            attrs = f'label="{escape(label)}", shape={kind}, fillcolor="{placement_colour(pls)}"'
        else:
            op = op_name(n)
            label = f"{op}\n[{shape}]\n{placement}"
            attrs = f'label="{escape(label)}", shape=box, fillcolor="{placement_colour(pls)}"'
            if is_view_op(op):
                attrs += ", fontsize=7, height=0.2"
        members[s].append(f'"{n.name}" [{attrs}];')
    for stage in plan.stages:
        ranks = stage.ranks
        span = f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))
        mem = ""
        if stage.solution is not None:
            mem = f", est. memory {human_bytes(stage.solution.estimated_memory)}"
        label = (f"stage {stage.index}: group {stage.group}, ranks {span}, submesh {tuple(stage.mesh.shape)} "
                 f"{tuple(stage.mesh.axis_names)}{', recompute' if stage.recompute else ''}{mem}"
                 + _cut_label(stage, stage_of, captured))
        lines.append(f'  subgraph cluster_stage_{stage.index} {{ label="{escape(label)}"; style="rounded"; '
                     'color="#3182bd";')
        lines.extend("    " + m for m in members[stage.index])
        lines.append("  }")
    for n in nodes:
        if n.op != "call_function" or n.name not in stage_of:
            continue
        for src in dict.fromkeys(n.all_input_nodes):
            if src.name not in stage_of:
                continue
            a, b = stage_of[src.name], stage_of[n.name]
            if a == b:
                lines.append(f'  "{src.name}" -> "{n.name}";')
            else:
                lines.append(f'  "{src.name}" -> "{n.name}" [color="#de2d26", penwidth=1.6, '
                             f'label="p2p {a}->{b}", fontcolor="#de2d26"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cut_label(stage, stage_of: dict, captured) -> str:
    """The cut in front of ``stage``: where it starts and what it receives ("" for the first stage)."""
    if stage.index == 0 or not stage.nodes:
        return ""
    mine = set(stage.nodes)
    first = captured.node(stage.nodes[0])
    module = first.meta.get(MODULE) or "-"
    received: dict[str, int] = {}
    for name in stage.nodes:
        for src in captured.node(name).all_input_nodes:
            if src.op == "call_function" and src.name not in mine and src.name in stage_of:
                received.setdefault(src.name, stage_of[src.name])
    what = ", ".join(f"{v} from stage {s}" for v, s in received.items())
    return f"\ncut before {first.name} (module {module}); receives {what or 'nothing'}"
