"""Draw a plan's partition with graphviz.

Each op is a box showing its output placement per mesh axis; parameters and inputs are ellipses
with their storage/entry placement; every inserted collective is its own red node on the edge it
serves, labelled with its kind, mesh axis, bytes and estimated time. Ops are grouped into clusters
by their module path up to the repeated-block index (``blocks.0``), so one transformer block reads
as one box of ops.
"""
from __future__ import annotations

import os
import re
import shutil

from autoshard.passes.graph import MODULE, outputs
from autoshard.passes.solve.planner import human_bytes
from autoshard.passes.spec import Partial, Shard

_VIEW_OPS = ("view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "getitem",
             "split", "t", "alias", "detach", "_unsafe_view", "flatten", "contiguous")


def _escape(text: str) -> str:
    """Quote-safe dot label text; real newlines become dot's centred line breaks."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_human_bytes = human_bytes


def _human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _axes_label(pls, axis_names) -> str:
    return ", ".join(f"{a}:{_short(p)}" for a, p in zip(axis_names, pls))


def _short(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    return "R"


def _colour(pls) -> str:
    if any(isinstance(p, Partial) for p in pls):
        return "#fdd9a0"
    if any(isinstance(p, Shard) for p in pls):
        return "#c6dbef"
    return "#f0f0f0"


def _cluster_key(module_path: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``; ``fc1`` -> ``fc1``; "" -> ""."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def _op_name(node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return re.sub(r"\.default$", "", str(getattr(target, "_opname", name) if hasattr(target, "_opname") else name))


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
        f'est. step {_human_time(plan.estimated_step_time)}, est. memory {_human_bytes(plan.estimated_memory)}"];',
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
        placement = _axes_label(out_pls, names) if out_pls else "-"
        metas = [m for m in outputs(node) if m is not None]
        shape = "x".join(str(s) for s in metas[0].shape) if metas else ""
        if node.op == "placeholder":
            if node.name in param_of:
                label, shape_kind = f"{param_of[node.name]}\n[{shape}]\n{placement}", "ellipse"
            elif node.name in input_names:
                label, shape_kind = f"input {node.name}\n[{shape}]\n{placement}", "invhouse"
            else:
                label, shape_kind = f"buffer {captured.buffers.get(node.name, node.name)}\n{placement}", "ellipse"
            lines.append(f'  "{node.name}" [label="{_escape(label)}", shape={shape_kind}, fillcolor="{_colour(out_pls)}"];')
            continue
        op = _op_name(node)
        small = any(op.startswith(v) for v in _VIEW_OPS)
        label = f"{op}\n[{shape}]\n{placement}"
        attrs = f'label="{_escape(label)}", shape=box, fillcolor="{_colour(out_pls)}"'
        if small:
            attrs += ", fontsize=7, height=0.2"
        clusters.setdefault(_cluster_key(node.meta.get(MODULE, "")), []).append(f'"{node.name}" [{attrs}];')
    for i, (key, members) in enumerate(clusters.items()):
        if key:
            lines.append(f'  subgraph cluster_{i} {{ label="{_escape(key)}"; style="rounded,dashed"; color="#9e9e9e";')
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
                items = [f"{c.kind}({names[c.axis]}) {_human_bytes(c.bytes)} {_human_time(c.seconds)}"
                         for c in r.collectives] or ["local chunk"]
                label = "\n".join(items)
                lines.append(f'  "{cid}" [label="{_escape(label)}", shape=cds, fillcolor="#fc9272", fontsize=8];')
                lines.append(f'  "{src.name}" -> "{cid}";')
                lines.append(f'  "{cid}" -> "{node.name}";')
    for k, (pname, syncs) in enumerate(sorted(sol.param_grad_syncs.items())):
        if not syncs:
            continue
        node_name = next((n for n, fqn in param_of.items() if fqn == pname), None)
        if node_name is None:
            continue
        label = "grad " + "\n".join(f"{c.kind}({names[c.axis]}) {_human_bytes(c.bytes)} {_human_time(c.seconds)}"
                                     for c in syncs)
        lines.append(f'  "gsync_{k}" [label="{_escape(label)}", shape=note, fillcolor="#fee0d2", fontsize=7];')
        lines.append(f'  "{node_name}" -> "gsync_{k}" [style=dotted, arrowhead=none];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(dot_text: str, path: str) -> str:
    """Render dot text to ``path`` (format from its suffix: .svg, .png, .pdf). Returns the path.

    Where graphviz's ``dot`` program is missing, writes the dot text next to ``path`` and raises
    RuntimeError naming that file and how to render it (``apt-get install graphviz``)."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "svg"
    if shutil.which("dot") is None:
        dot_path = os.path.splitext(path)[0] + ".dot"
        with open(dot_path, "w") as f:
            f.write(dot_text)
        raise RuntimeError(
            f"graphviz's `dot` program is not installed, so {path} was not drawn; the partition was written "
            f"to {dot_path}. Install graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install "
            f"graphviz) and run: dot -T{fmt} {dot_path} -o {path}")
    import graphviz
    data = graphviz.Source(dot_text).pipe(format=fmt)
    with open(path, "wb") as f:
        f.write(data)
    return path
