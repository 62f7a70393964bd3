"""Draw a plan's partition with graphviz, op by op.

Each op is a box showing its output placement per mesh axis; parameters and inputs are ellipses
with their storage/entry placement; every inserted collective is its own red node on the edge it
serves, labelled with its kind, mesh axis, bytes and estimated time. Without a pipeline, ops are
grouped into clusters by their module path up to the repeated-block index (``blocks.0``), so one
transformer block reads as one box of ops; a pipeline's are grouped by stage, with the transfers
between stages on red ``p2p`` edges.
"""
from __future__ import annotations

from autoshard.drawing.dot import axes_label, escape, is_view_op, op_name, placement_colour
from autoshard.passes.cost.collectives import axis_label
from autoshard.passes.graph import MODULE, outputs
from autoshard.passes.units import human_bytes, human_time

__all__ = ["plan_to_dot"]


def _cluster_key(module_path: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``; ``fc1`` -> ``fc1``; "" -> ""."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def plan_to_dot(plan) -> str:
    """Graphviz dot text for ``plan`` (which must carry its captured graph), op by op. Without a
    pipeline, ops are clustered by module; a pipeline's ops are clustered by stage instead (its index,
    rank group, ranks, submesh, recompute, memory and the cut in front of it), each op placed by its
    stage's plan, and an edge between stages is a point-to-point transfer (red, ``p2p a->b``; a value
    that skips stages goes straight from its producer's stage to its consumer's, as the runtime
    sends it)."""
    if plan.captured is None:
        raise ValueError("this plan has no captured graph (it was loaded from JSON): compile or plan it "
                         "against the model first, e.g. load_plan(p).attach(capture(...), mesh)")
    captured, pipelined = plan.captured, plan.pipelined
    stage_of = {name: s.index for s in plan.stages for name in s.nodes} if pipelined else {}
    if pipelined:  # placeholders live with their first consumer's stage
        for node in captured.gm.graph.nodes:
            if node.op == "placeholder":
                readers = [stage_of[u.name] for u in node.users if u.name in stage_of]
                if readers:
                    stage_of[node.name] = min(readers)
    by_index = {s.index: s for s in plan.stages}

    def stage(name: str):
        return by_index[stage_of.get(name, 0)] if pipelined else plan.stages[0]

    title = (f"autoshard {'pipelined ' if pipelined else ''}plan: mesh {plan.mesh.shape} "
             f"{tuple(plan.mesh.axis_names)}, hardware {plan.hardware}"
             + (f", pp {plan.pp} x {plan.virtual} virtual, {plan.schedule}, {plan.microbatches} microbatches"
                if pipelined else "")
             + f", est. step {human_time(plan.estimated_step_time)}, est. memory {human_bytes(plan.estimated_memory)}")
    lines = [
        "digraph autoshard_plan {",
        f'  graph [rankdir=TB, fontname="Helvetica", fontsize=11, labelloc=t, label="{escape(title)}"];',
        '  node [fontname="Helvetica", fontsize=9, style=filled];',
        '  edge [fontname="Helvetica", fontsize=8, color="#606060"];',
    ]
    clusters: dict = {("stage", st.index): [] for st in plan.stages} if pipelined else {}
    param_of = captured.params
    input_names = set(captured.inputs) | ({captured.target} if captured.target else set())
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function") or (pipelined and node.name not in stage_of):
            continue
        st = stage(node.name)
        names = st.mesh.axis_names
        strat = st.solution.strategies.get(node.name) if st.solution is not None else None
        out_pls = strat.outputs[0] if strat is not None and strat.outputs else ()
        placement = axes_label(out_pls, names) if out_pls else "-"
        metas = [m for m in outputs(node) if m is not None]
        shape = "x".join(str(s) for s in metas[0].shape) if metas else ""
        if node.op == "placeholder":
            if node.name in param_of:
                label, shape_kind = f"{param_of[node.name]}\n[{shape}]\n{placement}", "ellipse"
            elif node.name in input_names:
                label, shape_kind = f"input {node.name}\n[{shape}]\n{placement}", "invhouse"
            else:
                label, shape_kind = f"buffer {captured.buffers.get(node.name, node.name)}\n{placement}", "ellipse"
            line = f'"{node.name}" [label="{escape(label)}", shape={shape_kind}, fillcolor="{placement_colour(out_pls)}"];'
            if not pipelined:
                lines.append("  " + line)
                continue
        else:
            op = op_name(node)
            label = f"{op}\n[{shape}]\n{placement}"
            line = f'"{node.name}" [label="{escape(label)}", shape=box, fillcolor="{placement_colour(out_pls)}"'
            line += (", fontsize=7, height=0.2" if is_view_op(op) else "") + "];"
        key = ("stage", st.index) if pipelined else _cluster_key(node.meta.get(MODULE, ""))
        clusters.setdefault(key, []).append(line)
    for i, (key, members) in enumerate(clusters.items()):
        if pipelined:
            lines.append(f'  subgraph cluster_stage_{key[1]} {{ label="{escape(_stage_label(by_index[key[1]], stage_of, captured))}"; '
                         'style="rounded"; color="#3182bd";')
        elif key:
            lines.append(f'  subgraph cluster_{i} {{ label="{escape(key)}"; style="rounded,dashed"; color="#9e9e9e";')
        if pipelined or key:
            lines.extend("    " + m for m in members)
            lines.append("  }")
        else:
            lines.extend("  " + m for m in members)
    lines += _edges(plan, captured, stage_of, stage)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _edges(plan, captured, stage_of: dict, stage) -> list[str]:
    """Every edge: through the collectives that redistribute it (red nodes), across stages as p2p, and
    each parameter's gradient syncs."""
    lines = []
    pipelined = plan.pipelined
    redistributed = {}
    for st in plan.stages:
        for k, r in enumerate(st.solution.redistributions if st.solution is not None else ()):
            redistributed.setdefault((r.producer, r.consumer), []).append((f"{st.index}_{k}", r, st))
    out_node = captured.output_node
    lines.append(f'  "{out_node.name}" [label="{"loss" if captured.loss_output else "output"}", shape=doublecircle, '
                 'fillcolor="#e5f5e0"];')
    for node in captured.gm.graph.nodes:
        if node.op not in ("call_function", "output") or (pipelined and node.op == "call_function"
                                                          and node.name not in stage_of):
            continue
        seen = set()
        for src in node.all_input_nodes:
            if src.name in seen or (pipelined and src.name not in stage_of):
                continue
            seen.add(src.name)
            a, b = stage_of.get(src.name, 0), stage_of.get(node.name, stage_of.get(src.name, 0))
            if pipelined and a != b and node.op != "output":
                lines.append(f'  "{src.name}" -> "{node.name}" [color="#de2d26", penwidth=1.6, '
                             f'label="p2p {a}->{b}", fontcolor="#de2d26"];')
                continue
            hops = redistributed.get((src.name, node.name))
            if not hops:
                lines.append(f'  "{src.name}" -> "{node.name}";')
                continue
            for cid, r, st in hops:
                items = [f"{c.kind}({axis_label(c.axis, st.mesh.axis_names)}) {human_bytes(c.bytes)} "
                         f"{human_time(c.seconds)}" for c in r.collectives] or ["local chunk"]
                lines.append(f'  "comm_{cid}" [label="{escape(chr(10).join(items))}", shape=cds, fillcolor="#fc9272", '
                             'fontsize=8];')
                lines.append(f'  "{src.name}" -> "comm_{cid}";')
                lines.append(f'  "comm_{cid}" -> "{node.name}";')
    k = 0
    for st in plan.stages:
        for pname, syncs in sorted((st.solution.param_grad_syncs if st.solution is not None else {}).items()):
            node_name = next((n for n, fqn in captured.params.items() if fqn == pname), None)
            if not syncs or node_name is None or (pipelined and stage_of.get(node_name) != st.index):
                continue
            label = "grad " + "\n".join(f"{c.kind}({axis_label(c.axis, st.mesh.axis_names)}) {human_bytes(c.bytes)} "
                                        f"{human_time(c.seconds)}" for c in syncs)
            lines.append(f'  "gsync_{k}" [label="{escape(label)}", shape=note, fillcolor="#fee0d2", fontsize=7];')
            lines.append(f'  "{node_name}" -> "gsync_{k}" [style=dotted, arrowhead=none];')
            k += 1
    return lines


def _stage_label(stage, stage_of: dict, captured) -> str:
    ranks = stage.ranks
    span = f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))
    mem = f", est. memory {human_bytes(stage.solution.estimated_memory)}" if stage.solution is not None else ""
    return (f"stage {stage.index}: group {stage.group}, ranks {span}, submesh {tuple(stage.mesh.shape)} "
            f"{tuple(stage.mesh.axis_names)}{', recompute' if stage.recompute else ''}{mem}"
            + _cut_label(stage, stage_of, captured))


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
