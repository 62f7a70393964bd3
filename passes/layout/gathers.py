"""Parameter gathers: which travel fused in one flat collective (and so are started ahead), and
which segment each belongs to. The runtime (``runtime.param_gather``, grouped by ``runtime.lower``)
gathers this way and the planner's memory timeline (``passes.solve.gather_timeline``) prices it.

A parameter's copy is made by the steps ``plan_redistribute(storage, need)``. When those are
all-gathers of one tensor dim, from the last sharding axis back (FSDP's case), one gather over the
axes flattened does the same: ``fused_gather`` gives (axes, dim). Such a redistribution, of a
parameter or of any other value, is one all-gather over the axes flattened in the program
(``runtime.lower``) and in its price (``passes.cost.model``). Fused copies of a segment travel
together and the runtime starts them ahead (forward and backward prefetch); other copies run their
steps one by one when needed.

Copies are grouped by the *segment* of their first reader, walking the program in order
(``SegmentKeys``): a block instance ("layers.3", every op of that instance, wherever it lies), or,
outside blocks, the run of ops after the n-th distinct block instance (key ``n``).

>>> from autoshard.passes.layout.redistribution import plan_redistribute
>>> from autoshard.passes.spec import R, S
>>> fused_gather(plan_redistribute((S(0), S(0)), (R, R), (2, 2)))
((0, 1), 0)
>>> fused_gather(plan_redistribute((S(0), S(0)), (R, S(0)), (2, 2))) is None   # gathers, then chunks
True
>>> keys = SegmentKeys()
>>> [keys.key(b) for b in (None, "layers.0", "layers.0", None, "layers.1", None)]
[0, 'layers.0', 'layers.0', 1, 'layers.1', 2]
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx

from autoshard.passes.graph import is_getitem
from autoshard.passes.layout.redistribution import Step

__all__ = ["fused_gather", "SegmentKeys", "segment_op", "gather_groups"]

_NOT_SEGMENT_OPS = {torch.ops.aten._assert_tensor_metadata.default}


def fused_gather(steps: Sequence[Step]) -> Optional[tuple[tuple[int, ...], int]]:
    """(mesh axes, tensor dim) when ``steps`` are all-gathers of one dim from the last sharding axis
    back (``plan_redistribute``'s order), so that one gather over those axes flattened does the
    same; else None (no steps, or any other kind of step)."""
    if not steps or any(s.kind != "all_gather" for s in steps):
        return None
    dims = {s.dim for s in steps}
    axes = [s.axis for s in steps]
    if len(dims) != 1 or axes != sorted(set(axes), reverse=True):
        return None
    return tuple(sorted(axes)), dims.pop()


def segment_op(node: fx.Node) -> bool:
    """Whether ``node`` is an op ``SegmentKeys`` counts (not a getitem, not a metadata assert)."""
    return node.op == "call_function" and not is_getitem(node) and node.target not in _NOT_SEGMENT_OPS


def gather_groups(first_uses: Iterable[tuple[int, Any, Any]]) -> list[list[Any]]:
    """Copies grouped as the runtime gathers them: ``first_uses`` holds (position of the first
    reader, its segment key, item) per copy; one group per segment key, groups in the order of
    their first reader, members in first-reader order."""
    groups: dict[Any, list] = {}
    for _, key, item in sorted(first_uses, key=lambda e: e[0]):
        groups.setdefault(key, []).append(item)
    return list(groups.values())


class SegmentKeys:
    """The gather segment of each op (``segment_op``), fed its block instance (None outside blocks)
    in program order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def key(self, block: Optional[str]) -> Union[str, int]:
        if block is None:
            return len(self.seen)
        if block not in self.seen:
            self.seen.append(block)
        return block
