"""Ops whose output shape depends on tensor values, refused with a clear error.

``torch.unique``, ``torch.nonzero``, boolean-mask indexing (``x[x > 0]``) and ``masked_select``
return as many elements as the data asks for. ``torch.export`` traces them with *unbacked* symbolic
sizes (``u0``), while autoshard plans and runs a program of static shapes (every placement, collective
and byte count is priced from concrete sizes). ``check_static_shapes`` finds the first op of a
traced graph whose output has such a size and raises ``TraceError`` naming the op, the user's line
that called it and what to do instead; without it the first pass that reads the size raised torch's
``GuardOnDataDependentSymNode`` from deep inside autoshard.

>>> check_static_shapes(graph, "Net")   # doctest: +SKIP
TraceError: autoshard could not capture Net: aten._unique2 (torch.unique) at model.py:12 in forward: ...
"""
from __future__ import annotations

import operator
import os
import re
from typing import Optional

import torch
import torch.fx as fx

from autoshard.passes.errors import TraceError

__all__ = ["check_static_shapes", "data_dependent_node"]

# ATen op -> the Python call users write, for the message
_FRIENDLY = {"_unique2": "torch.unique", "unique_dim": "torch.unique(dim=...)", "unique_consecutive":
             "torch.unique_consecutive", "nonzero": "torch.nonzero / boolean-mask indexing", "index":
             "boolean-mask indexing x[mask]", "masked_select": "torch.masked_select", "repeat_interleave":
             "torch.repeat_interleave with tensor repeats", "bincount": "torch.bincount without minlength"}

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _has_unbacked_size(value) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(t, torch.Tensor) and any(not isinstance(s, int) for s in t.shape) for t in values)


def data_dependent_node(graph: fx.Graph) -> Optional[fx.Node]:
    """The first op (in program order) whose output's shape depends on tensor values, else None."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem \
                and _has_unbacked_size(node.meta.get("val")):
            return node
    return None


def _user_line(node: fx.Node) -> str:
    """``file:line in fn: `code``` of the innermost frame of ``node``'s stack trace outside torch and
    autoshard's capture code, or "" when the trace has none."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frames = [m for m in _FRAME.finditer(node.meta.get("stack_trace") or "")
              if not os.path.abspath(m.group(1)).startswith(skip)]
    if not frames:
        return ""
    path, line, fn, code = frames[-1].groups()
    return f" at {path}:{line} in {fn}: `{code.strip()}`"


def check_static_shapes(graph: fx.Graph, model_name: str) -> None:
    """Raise ``TraceError`` when an op of ``graph`` (an export's graph, before autoshard's metadata is
    written) returns a value whose shape depends on tensor values (module docstring)."""
    node = data_dependent_node(graph)
    if node is None:
        return
    op = getattr(node.target, "_opname", None)  # an OpOverload: aten._unique2.default -> "_unique2"
    shown = f"aten.{op}" if op else str(getattr(node.target, "__name__", node.target))
    friendly = _FRIENDLY.get(op)
    raise TraceError(
        f"autoshard could not capture {model_name}: {shown}" + (f" ({friendly})" if friendly else "")
        + f"{_user_line(node)} returns a tensor whose size depends on the values of its input, and autoshard "
        f"plans a program of static shapes.\n"
        f"  fix: keep the size fixed: a mask applied with torch.where or multiplication instead of selecting "
        f"elements, torch.bincount(..., minlength=N) or a one-hot sum instead of torch.unique; or compute it outside "
        f"the model and pass the result in as an input.")
