"""``autoshard.register_sharding``: a custom ``torch.library`` op given a rule through the public API is
captured as one node, planned by that rule (the plan shows its placement), checked against the op
on pieces, and trains equal to one device on 4 gloo ranks. An op left without a rule runs replicated,
and the plan summary and ``InfeasiblePlanError`` say what that costs and how to register a rule."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.sharding.rules import RULES, lookup
from autoshard.passes.spec import Strategy1D
from autoshard.testing.custom_ops import swiglu_mlp
from autoshard.testing.equivalence import Tolerance, compiled_gradient_mismatches, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks
from autoshard.testing.rule_numerics import check_rule_numerics

SWIGLU = torch.ops.autoshard_testing.swiglu.default
ROW_SCALE = torch.ops.autoshard_testing.row_scale.default


# The user's part, at import (so every rank process registers it too): the fused gate is pointwise.
@autoshard.register_sharding(SWIGLU)
def swiglu_sharding(gate, up):
    return [([Shard(d), Shard(d)], [Shard(d)]) for d in range(gate.ndim)]


def _captured():
    torch.manual_seed(0)
    model, inputs, target, loss_fn = swiglu_mlp()
    return model, inputs, target, loss_fn, capture(model, inputs, loss_fn=loss_fn, target=target)


def _node(cg, target):
    return next(n.name for n in cg.gm.graph.nodes if n.target == target)


# Megatron's SwiGLU: w1 and w3 split by output rows, w2 by input columns, so the gate runs on hidden slices.
TP = {"params": {"w1.weight": ("S(0)",), "w3.weight": ("S(0)",), "w2.weight": ("S(1)",)}}


def test_custom_op_is_one_node_planned_by_its_rule():
    model, inputs, target, loss_fn, cg = _captured()
    node = _node(cg, SWIGLU)  # export kept the custom op whole
    assert lookup(SWIGLU) is RULES[SWIGLU]
    plan = plan_captured(cg, (4,), hardware="cpu", pins=TP)
    assert tuple(plan.strategies[node].outputs[0]) == (Shard(2),)  # hidden slices, no gather around it
    assert tuple(plan.strategies[node].inputs[0]) == (Shard(2),)
    assert plan.replicated_ops == [str(ROW_SCALE)]  # the op left without a rule


def test_the_rule_matches_the_op_on_pieces():
    report = check_rule_numerics(lambda g, u: SWIGLU(g, u), (torch.randn(4, 8), torch.randn(4, 8)), n=4)
    assert report.checked_str == {"(R, R)->(R)", "(S(0), S(0))->(S(0))", "(S(1), S(1))->(S(1))"}


def test_summary_and_infeasibility_name_the_op_without_a_rule_and_its_cost():
    *_, cg = _captured()
    summary = plan_captured(cg, (4,), hardware="cpu").summary()
    assert "autoshard_testing.row_scale.default x1: outputs 2.00 KiB per device (512 B if split over 4)" in summary
    assert "autoshard.register_sharding" in summary
    with pytest.raises(autoshard.InfeasiblePlanError) as err:
        plan_captured(cg, (4,), hardware="cpu", memory_limit=1000)
    msg = str(err.value)
    assert "for lack of a sharding rule: autoshard_testing.row_scale.default (1 node: outputs 2.00 KiB per device" in msg
    assert "autoshard.register_sharding(op)" in msg


def test_rule_forms_and_mistakes():
    captured = _captured()[-1]
    node = captured.node(_node(captured, SWIGLU))
    from autoshard.passes.sharding.rules import rule_strategies

    try:
        # DTensor's layout (one entry per schema argument), short strings, a Strategy1D, negative dims
        autoshard.register_sharding(SWIGLU, override=True)(lambda gate, up: [
            (["S(-1)", "S(-1)"], "S(-1)"), ([Replicate(), Shard(0)], [Shard(0)]),
            Strategy1D((Shard(1), Shard(1)), (Shard(1),))])
        assert {str(s) for s in rule_strategies(node)[0]} == {
            "(R, R)->(R)", "(S(2), S(2))->(S(2))", "(R, S(0))->(S(0))", "(S(1), S(1))->(S(1))"}
        autoshard.register_sharding(SWIGLU, override=True)(lambda gate, up: [([Shard(0)], [Shard(0)])])
        with pytest.raises(ValueError, match="1 input placements; the op has 2 tensor operands"):
            rule_strategies(node)
        autoshard.register_sharding(SWIGLU, override=True)(lambda gate, up: [([Shard(3), Shard(0)], [Shard(0)])])
        with pytest.raises(ValueError, match=r"Shard\(3\) on a 3-d tensor"):
            rule_strategies(node)
    finally:
        autoshard.register_sharding(SWIGLU, override=True)(swiglu_sharding)
    with pytest.raises(ValueError, match="already has a sharding rule"):
        autoshard.register_sharding(SWIGLU)(swiglu_sharding)
    with pytest.raises(TypeError, match="qualified"):
        autoshard.register_sharding("swiglu")
    with pytest.raises(TypeError, match="op overload"):
        autoshard.register_sharding(F.silu)


def _train_worker(rank, world):
    from autoshard.compiled import CompiledModel
    from autoshard.plans import Plan
    from autoshard.runtime.groups import broadcast_json, setup_distributed

    model, inputs, target, loss_fn, cg = _captured()
    tol = Tolerance()
    failures = []
    for mesh in ((4,), (2, 2)):
        env = setup_distributed(autoshard.Mesh.of(mesh))
        cases = [("solver", None, {}), ("random", 3, {}), ("random", 4, {})]
        if mesh == (4,):
            cases.append(("tensor parallel", None, TP))
        for name, seed, pins in cases:
            payload = (plan_captured(cg, mesh, hardware="cpu", random_seed=seed, pins=pins).to_json()
                       if rank == 0 else None)
            plan = Plan.from_json(broadcast_json(payload, src=0, env=env)).attach(cg, autoshard.Mesh.of(mesh))
            label = f"swiglu mlp {mesh} {name} {seed or ''}"
            failures += train_against_one_device(
                label, CompiledModel(model, plan, env), copy.deepcopy(model), (inputs, target), loss_fn=loss_fn,
                steps=2, check_gradients=lambda p, r, label=label: compiled_gradient_mismatches(label, p, r, tol))
    return failures


def test_custom_op_trains_equal_to_one_device_on_4_ranks():
    failures = failures_of(run_ranks(_train_worker, 4, timeout=600))
    assert not failures, "\n".join(failures)
