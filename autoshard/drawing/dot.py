"""What every partition drawing shares: dot label text, placement colours, op names, rendering.

>>> axes_label((Shard(0), Partial()), ("dp", "tp")), placement_colour((Shard(0), Partial()))
('dp:S(0), tp:P', '#fdd9a0')
"""
from __future__ import annotations

import os
import re
import shutil

from autoshard.passes.spec import Partial, Shard

__all__ = ["VIEW_OPS", "escape", "axes_label", "short_placement", "placement_colour", "op_name", "is_view_op",
           "render_dot"]

#: op names drawn small: they move no data of their own
VIEW_OPS = ("view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "getitem",
            "split", "t", "alias", "detach", "_unsafe_view", "flatten", "contiguous")


def escape(text: str) -> str:
    """Quote-safe dot label text; real newlines become dot's centred line breaks."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def short_placement(p) -> str:
    """``S(dim)``, ``P`` or ``R``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    return "R"


def axes_label(pls, axis_names) -> str:
    """One placement per mesh axis, named: ``dp:S(0), tp:R``."""
    return ", ".join(f"{a}:{short_placement(p)}" for a, p in zip(axis_names, pls))


def placement_colour(pls) -> str:
    """Fill colour of a value: orange when partial on some axis, blue when sharded, grey when replicated."""
    if any(isinstance(p, Partial) for p in pls):
        return "#fdd9a0"
    if any(isinstance(p, Shard) for p in pls):
        return "#c6dbef"
    return "#f0f0f0"


def op_name(node) -> str:
    """The ATen op an fx node calls, without ``.default`` (``addmm``, ``view``)."""
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return re.sub(r"\.default$", "", str(getattr(target, "_opname", name) if hasattr(target, "_opname") else name))


def is_view_op(op: str) -> bool:
    """Whether ``op`` (an ``op_name``) is drawn small, as a view."""
    return any(op.startswith(v) for v in VIEW_OPS)


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
    import graphviz  # the Python binding is optional: only rendering needs it
    data = graphviz.Source(dot_text).pipe(format=fmt)
    with open(path, "wb") as f:
        f.write(data)
    return path
