"""Which stage submeshes a user's parameter pins can hold.

``compile(pp=..., params=...)`` pins parameters per axis of a stage's (dp, tp) submesh, and the pins
are applied when the stages are re-solved on the submesh the pipeline search chose
(``retrace.replan_at_microbatch``). A submesh where a pin shards along an axis of size 1 (``S(d)``, or a
ZeRO form such as ``R/zero2``) would take the pin as a no-op (the storage forms fall back to the plain
one there) or refuse it, so the search plans only the submeshes that hold every pin as written
(``usable_stage_shapes``); when none does, ``PinError`` says so before anything is solved.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping, Optional, Sequence

from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.layout.shapes import why_not_divisible
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Shard, TensorMeta
from autoshard.passes.sharding.storage_forms import fmt_storage
from autoshard.passes.sharding.pins import PinError, parse_param_pin
from autoshard.passes.pipeline.stages.layer_costs import submesh_shapes

__all__ = ["why_pins_miss_submesh", "usable_stage_shapes"]


def why_pins_miss_submesh(captured: CapturedGraph, params: Mapping[str, Any], submesh: Mesh) -> Optional[str]:
    """None when every pin of ``params`` (the ``params=`` keyword: pattern -> placements per submesh
    axis) holds as written on ``submesh``; else the first reason it does not: a pin that does not parse
    on the submesh's axes, one that shards (``S(d)`` or a ZeRO form) along an axis of size 1, or an
    ``S(d)`` that does not divide a parameter it matches."""
    fqns = dict(captured.aliases)
    shapes = {}
    for node, fqn in captured.params.items():
        meta = captured.node(node).meta.get(META)
        shapes[fqn] = tuple(meta.shape) if isinstance(meta, TensorMeta) else None
    shapes.update({alias: shapes.get(canon) for alias, canon in fqns.items()})
    for pattern, value in params.items():
        what = f"pin params[{pattern!r}]"
        try:
            pls, forms = parse_param_pin(value, submesh, what)
        except PinError as e:
            return str(e)
        forms = forms or (None,) * submesh.ndim
        for axis, (p, form, size) in enumerate(zip(pls, forms, submesh.shape)):
            if size == 1 and (isinstance(p, Shard) or form):
                return (f"{what} = {fmt_storage(pls, forms)} shards along axis {axis} "
                        f"({submesh.axis_names[axis]!r}), which has size 1 on the submesh {submesh.shape}")
        for fqn, shape in shapes.items():
            if shape is not None and fnmatch.fnmatchcase(fqn, pattern):
                why = why_not_divisible(shape, pls, submesh)
                if why:
                    return f"{what}: parameter {fqn!r} of shape {shape}: {why}"
    return None


def usable_stage_shapes(captured: CapturedGraph, mesh: Mesh, hardware, params: Optional[Mapping[str, Any]],
                        pps: Sequence[int]) -> Optional[list[tuple[int, int]]]:
    """The (dp, tp) stage submeshes of every pp in ``pps`` (pp > 1 dividing the mesh; the search's own
    shapes, ``layer_costs.submesh_shapes``) on which ``params`` hold as written; None when nothing is
    pinned (every shape is searched). ``PinError`` when no submesh holds them, naming each shape's reason."""
    if not params:
        return None
    usable, reasons = [], {}
    for p in pps:
        if p <= 1 or mesh.size % p:
            continue
        for shape in submesh_shapes(mesh.size // p, hardware):
            why = why_pins_miss_submesh(captured, params, Mesh(shape))
            if why is None:
                usable.append(shape)
            else:
                reasons[shape] = why
    if not usable:
        listed = "; ".join(f"(dp, tp) = {s}: {why}" for s, why in reasons.items())
        raise PinError(f"the params pins fit no stage submesh of the pipeline (pp in {sorted(set(pps))} on mesh "
                       f"{mesh.shape}, {math.prod(mesh.shape)} devices): {listed}. Pins under a pipeline give one "
                       "placement per axis of a stage's (dp, tp) submesh; shard only along an axis the stage has")
    return usable
