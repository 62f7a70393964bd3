"""The default plan picture (``autoshard/drawing/block_graph.py``): block level, repeated blocks folded.

Checked on the dot text, in one process: a GPT's identical blocks are one box marked with their
count, blocks the plan treats differently are not folded together, every collective of the plan is
drawn exactly once (inside a box, between two folded blocks, or on an edge: the bytes add up to the
plan's), the title carries step time, memory and MFU, the legend is there, and the op-level graph
is still one keyword away. A pipelined plan folds identical consecutive stages. With graphviz
installed, a tiny Llama with the Llama-3 8B's structure renders to a PNG that fits a 1920 x 1080 screen.
"""
from __future__ import annotations

import re
import shutil
import struct

import pytest
import torch

import autoshard
from autoshard.drawing.segments import fold, segments, traffic
from autoshard.drawing import plan_to_dot
from autoshard.testing.models import gpt, hf_llama


def _plan(n_layer=4, mesh=(2, 2), **pins):
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(n_layer=n_layer)
    return autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu", **pins)


def _boxes(dot: str) -> list[str]:
    return re.findall(r"<B>([^<]+)</B>", dot)


def test_identical_blocks_fold_into_one_box_with_their_count():
    plan = _plan(n_layer=4, params={"blocks.*.fc.weight": ("R", "S(0)"), "blocks.*.out.weight": ("R", "S(1)")})
    dot = plan.to_dot()
    assert _boxes(dot).count("blocks.0-3") == 1 and "\u00d74" in dot
    assert not any(b.startswith("blocks.") and b != "blocks.0-3" for b in _boxes(dot)) and "legend" in dot
    assert len(_boxes(dot)) <= 8  # wte, wpe, the blocks, ln_f, head (+ the legend's title)
    assert "dp:R, tp:S(0)" in dot  # the pinned placement, per mesh axis, in the block's parameter rows
    title = re.search(r'label="(autoshard plan:[^"]+)"', dot).group(1)
    assert "est. step" in title and "per device" in title and "MFU" in title
    assert plan.to_dot("ops") == plan_to_dot(plan) and '"comm_' in plan.to_dot("ops")
    with pytest.raises(ValueError, match="detail"):
        plan.to_dot("layers")


def test_blocks_planned_differently_stay_apart():
    plan = _plan(n_layer=3, params={"blocks.1.fc.weight": ("R", "S(0)"), "blocks.1.out.weight": ("R", "S(1)")})
    units = fold(segments(plan.captured), plan.solution, plan.captured)
    assert [u.label for u in units if u.block] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [u.count for u in units if u.block] == [1, 1, 1]


@pytest.mark.parametrize("seed", [None, 3])
def test_every_collective_is_drawn_once(seed):
    """The bytes inside boxes (per instance x instances), between folded blocks (x gaps) and on edges add
    up to the plan's redistributions; gradient syncs to the plan's."""
    plan = _plan(n_layer=3, random_seed=seed) if seed is not None else _plan(
        n_layer=3, params={"blocks.*.fc.weight": ("R", "S(0)")}, inputs={0: ("S(0)", "R")})
    units = fold(segments(plan.captured), plan.solution, plan.captured)
    moves = traffic(units, plan.solution, plan.captured)
    drawn = sum(c.bytes * units[u].count for u, t in moves.inside.items() for c in t.values())
    drawn += sum(c.bytes * (units[u].count - 1) for u, t in moves.between.items() for c in t.values())
    drawn += sum(c.bytes for t in moves.edges.values() for c in t.values())
    want = sum(c.bytes for r in plan.solution.redistributions for c in r.collectives)
    assert want > 0 and drawn == pytest.approx(want)
    synced = sum(c.bytes * units[u].count for u, t in moves.grad_sync.items() for c in t.values())
    assert synced == pytest.approx(sum(c.bytes for v in plan.solution.param_grad_syncs.values() for c in v))


def test_pipelined_plan_folds_identical_stages():
    """Four stages of 5 identical blocks on a slow-linked mesh: the two middle stages are one cluster
    (and one summary row)."""
    import dataclasses
    from autoshard.passes.cost.hardware_lookup import get_hardware
    slow = dataclasses.replace(get_hardware("cpu"), name="slow-net", devices_per_node=1, inter_node_bandwidth=1e6,
                               inter_node_latency=1e-3)
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt(n_layer=20, d=16, n_head=2, seq=8)
    plan = autoshard.plan(model, (4,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware=slow, pp=4, schedule="1f1b", microbatches=2,
                          stages=["blocks.5", "blocks.10", "blocks.15"])
    assert plan.pipelined and len(plan.stages) == 4
    dot = plan.to_dot()
    clusters = re.findall(r'subgraph cluster_\d+ \{ label="([^"]+)"', dot)
    assert len(clusters) == 3 and clusters[1].startswith("stages 1-2 (\u00d72)"), clusters
    assert "p2p" in dot and "blocks.5-9" in dot and "\u00d75" in dot
    assert "cluster" in plan.to_dot("ops") and plan.to_dot("ops").count("subgraph cluster_stage_") == 4
    assert "stages 1-2 (x2) groups 1-2" in plan.summary() and "blocks.5-14 (5 blocks each)" in plan.summary()


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot program renders the picture")
def test_llama_picture_fits_one_screen(tmp_path):
    """A tiny Llama has the Llama-3 8B's modules (same names, nine weights a block): its default picture on
    (8, 8) must fit 1920 x 1080 pixels (``benchmarks`` render the 8B itself)."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = hf_llama()
    plan = autoshard.plan(model, (8, 8), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="h100")
    width, height = _png_size(plan.render(str(tmp_path / "llama.png")))
    assert width <= 1920 and height <= 1080, (width, height)
    assert "\u00d7" in plan.to_dot()  # its blocks folded
