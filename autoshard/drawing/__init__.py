"""Pictures of a partition as graphviz dot text, and rendering them to SVG/PNG/PDF.

- ``plan_graph``: ``plan_to_dot(plan)``, one sharded program: ops with their placements, every
  inserted collective and gradient sync on its own node, repeated blocks in clusters.
- ``pipeline_graph``: ``pipeline_to_dot(pipeline_plan, captured)``, one cluster per pipeline stage.
- ``dot``: what both share (labels, placement colours, op names) and ``render_dot``.

May import: ``autoshard.passes`` (graph, spec, units) and graphviz. Never the runtime.
"""
from autoshard.drawing.dot import render_dot
from autoshard.drawing.pipeline_graph import pipeline_to_dot
from autoshard.drawing.plan_graph import plan_to_dot

__all__ = ["plan_to_dot", "pipeline_to_dot", "render_dot"]
