"""``Plan`` at the front door: the one plan type (``passes.pipeline.plan``), how people read it, and files.

A plan is a list of stages under a schedule: one stage on the whole mesh without a pipeline, a
pipeline's stages on rank groups with ``pp=`` (its docstring says everything it holds). This module
registers the views the plan's methods call (``summary()`` -> ``autoshard.summary``, ``to_dot()`` /
``render()`` -> ``autoshard.drawing``, ``explain()`` -> ``autoshard.explain``) and reads plan files:
``load_plan`` (JSON only, never pickle; files of version 1, either kind, are read too).
"""
from __future__ import annotations

from autoshard.drawing import plan_dot, render_dot
from autoshard.explain import explain
from autoshard.passes.pipeline.plan import Plan, Stage, register_view
from autoshard.passes.pipeline.plan_file import PLAN_FORMAT, PLAN_VERSION, graph_fingerprint, read_plan_json
from autoshard.passes.pipeline.plan_work import hardware_label, plan_work
from autoshard.passes.spec import fmt_placements
from autoshard.summary import plan_summary

__all__ = ["Plan", "Stage", "load_plan", "graph_fingerprint", "plan_work", "hardware_label", "PLAN_FORMAT",
           "PLAN_VERSION"]

register_view("summary", plan_summary)
register_view("to_dot", plan_dot)
register_view("render_dot", render_dot)
register_view("explain", explain)


def load_plan(path: str) -> Plan:
    """Read a plan written by ``Plan.save`` (JSON only; nothing is executed)."""
    return Plan.from_json(read_plan_json(path))


def describe_placements(pls) -> str:
    return fmt_placements(pls)
