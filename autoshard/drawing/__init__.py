"""Pictures of a partition as graphviz dot text, and rendering them to SVG/PNG/PDF.

- ``block_graph``: the default picture, at block level (``block_plan_to_dot(plan)``,
  ``block_pipeline_to_dot(pipelined_plan)``): one box per module segment, repeated blocks and
  identical pipeline stages folded, placements per mesh axis, collectives with bytes and time.
  ``segments`` cuts a program into those boxes.
- ``plan_graph``: ``plan_to_dot(plan)``, one sharded program op by op: ops with their placements,
  every inserted collective and gradient sync on its own node, repeated blocks in clusters.
- ``pipeline_graph``: ``pipeline_to_dot(pipeline_plan, captured)``, op by op, one cluster per stage.
- ``dot``: what all share (labels, placement colours, op names) and ``render_dot``.

May import: ``autoshard.passes`` (graph, spec, units) and graphviz. Never the runtime.
"""
from autoshard.drawing.block_graph import block_pipeline_to_dot, block_plan_to_dot
from autoshard.drawing.dot import render_dot
from autoshard.drawing.pipeline_graph import pipeline_to_dot
from autoshard.drawing.plan_graph import plan_to_dot

__all__ = ["plan_to_dot", "pipeline_to_dot", "block_plan_to_dot", "block_pipeline_to_dot", "render_dot"]
