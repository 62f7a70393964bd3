"""Pictures of a partition as graphviz dot text, and rendering them to SVG/PNG/PDF.

- ``block_graph``: the default picture, at block level (``block_plan_to_dot(plan)``): one box per
  module segment, repeated blocks and identical pipeline stages folded, placements per mesh axis,
  collectives with bytes and time. ``segments`` cuts a program into those boxes.
- ``plan_graph``: ``plan_to_dot(plan)``, op by op: ops with their placements, every inserted
  collective and gradient sync on its own node, repeated blocks in clusters (a pipeline: one cluster
  per stage, p2p edges between them).
- ``dot``: what all share (labels, placement colours, op names) and ``render_dot``.

``plan_dot(plan, detail)`` is the one entry ``Plan.to_dot`` calls: blocks or ops, the pipeline's
stages drawn only when the plan has several.

May import: ``autoshard.passes`` (graph, spec, units) and graphviz. Never the runtime.
"""
from autoshard.drawing.block_graph import block_plan_to_dot
from autoshard.drawing.dot import render_dot
from autoshard.drawing.plan_graph import plan_to_dot

__all__ = ["plan_dot", "plan_to_dot", "block_plan_to_dot", "render_dot"]


def plan_dot(plan, detail: str = "blocks") -> str:
    """Graphviz dot text of ``plan`` at ``detail`` ("blocks" or "ops"; see ``Plan.to_dot``)."""
    return block_plan_to_dot(plan) if detail == "blocks" else plan_to_dot(plan)
