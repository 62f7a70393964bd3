"""Draw a plan's partition with graphviz.

Each op is a box showing its output placement per mesh axis; parameters and inputs are ellipses
with their storage/entry placement; every inserted collective is its own red node on the edge it
serves, labelled with its kind, mesh axis, bytes and estimated time. Ops are grouped into clusters
by their module path up to the repeated-block index (``blocks.0``), so one transformer block reads
as one box of ops.
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
    """Graphviz dot text for ``plan`` (which must carry its captured graph)."""
    if plan.captured is None:
        raise ValueError("this plan has no captured graph (it was loaded from JSON): compile or plan it "
                         "against the model first, e.g. load_plan(p).attach(capture(...), mesh)")
    captured, sol, names = plan.captured, plan.solution, plan.mesh.axis_names
    strategies = sol.strategies
    lines = [
        "digraph autoshard_plan {",
        '  graph [rankdir=TB, fontname="Helvetica", fontsize=11, labelloc=t, '
        f'label="autoshard plan: mesh {plan.mesh.shape} {tuple(names)}, hardware {plan.hardware}, '
        f'est. step {human_time(plan.estimated_step_time)}, est. memory {human_bytes(plan.estimated_memory)}"];',
        '  node [fontname="Helvetica", fontsize=9, style=filled];',
        '  edge [fontname="Helvetica", fontsize=8, color="#606060"];',
    ]
    clusters: dict[str, list[str]] = {}
    param_of = captured.params
    input_names = set(captured.inputs) | ({captured.target} if captured.target else set())
    for node in captured.gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        strat = strategies.get(node.name)
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
            lines.append(f'  "{node.name}" [label="{escape(label)}", shape={shape_kind}, fillcolor="{placement_colour(out_pls)}"];')
            continue
        op = op_name(node)
        label = f"{op}\n[{shape}]\n{placement}"
        attrs = f'label="{escape(label)}", shape=box, fillcolor="{placement_colour(out_pls)}"'
        if is_view_op(op):
            attrs += ", fontsize=7, height=0.2"
        clusters.setdefault(_cluster_key(node.meta.get(MODULE, "")), []).append(f'"{node.name}" [{attrs}];')
    for i, (key, members) in enumerate(clusters.items()):
        if key:
            lines.append(f'  subgraph cluster_{i} {{ label="{escape(key)}"; style="rounded,dashed"; color="#9e9e9e";')
            lines.extend("    " + m for m in members)
            lines.append("  }")
        else:
            lines.extend("  " + m for m in members)

    redistributed = {}
    for k, r in enumerate(sol.redistributions):
        redistributed.setdefault((r.producer, r.consumer), []).append((k, r))
    out_node = captured.output_node
    lines.append(f'  "{out_node.name}" [label="{"loss" if captured.loss_output else "output"}", shape=doublecircle, '
                 'fillcolor="#e5f5e0"];')
    for node in captured.gm.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        seen = set()
        for src in node.all_input_nodes:
            if src.name in seen:
                continue
            seen.add(src.name)
            hops = redistributed.get((src.name, node.name))
            if not hops:
                lines.append(f'  "{src.name}" -> "{node.name}";')
                continue
            for k, r in hops:
                cid = f"comm_{k}"
                items = [f"{c.kind}({axis_label(c.axis, names)}) {human_bytes(c.bytes)} {human_time(c.seconds)}"
                         for c in r.collectives] or ["local chunk"]
                label = "\n".join(items)
                lines.append(f'  "{cid}" [label="{escape(label)}", shape=cds, fillcolor="#fc9272", fontsize=8];')
                lines.append(f'  "{src.name}" -> "{cid}";')
                lines.append(f'  "{cid}" -> "{node.name}";')
    for k, (pname, syncs) in enumerate(sorted(sol.param_grad_syncs.items())):
        if not syncs:
            continue
        node_name = next((n for n, fqn in param_of.items() if fqn == pname), None)
        if node_name is None:
            continue
        label = "grad " + "\n".join(
            f"{c.kind}({axis_label(c.axis, names)}) {human_bytes(c.bytes)} {human_time(c.seconds)}" for c in syncs)
        lines.append(f'  "gsync_{k}" [label="{escape(label)}", shape=note, fillcolor="#fee0d2", fontsize=7];')
        lines.append(f'  "{node_name}" -> "gsync_{k}" [style=dotted, arrowhead=none];')
    lines.append("}")
    return "\n".join(lines) + "\n"
