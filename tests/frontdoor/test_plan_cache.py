"""``Mesh.for_world`` and the plan cache of elastic runs (``autoshard.plan_cache``): one process, no
process group."""
from __future__ import annotations

import os

import pytest

import autoshard
from autoshard.plan_cache import cached_or_planned, cached_plan_path, model_fingerprint, plan_line
from autoshard.testing.models import gpt


def test_mesh_for_world_spans_nodes_only_when_there_are_several():
    assert autoshard.Mesh.for_world(4, 2).shape == (2, 2)
    assert autoshard.Mesh.for_world(16, 8).shape == (2, 8)
    assert autoshard.Mesh.for_world(2, 2).shape == (2,)     # one node left: a 1-D mesh
    assert autoshard.Mesh.for_world(3).shape == (3,)
    assert autoshard.Mesh.for_world(56, 8).shape == (7, 8)
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        autoshard.Mesh.for_world(6, 4)


def test_a_plan_is_cached_per_world_and_model(tmp_path):
    model, inputs, target, loss_fn = gpt()
    fp = model_fingerprint(model, inputs, loss_fn, target)
    assert fp == model_fingerprint(model, inputs, loss_fn, target)
    mesh2, mesh4 = autoshard.Mesh.for_world(2, 2), autoshard.Mesh.for_world(4, 2)
    calls = []

    def make(mesh):
        def solve():
            calls.append(mesh.shape)
            return autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                  hardware="cpu")
        return solve

    first, cached, _ = cached_or_planned(make(mesh2), str(tmp_path), mesh2, fp)
    assert not cached and os.path.exists(cached_plan_path(str(tmp_path), mesh2, fp))
    again, cached, _ = cached_or_planned(make(mesh2), str(tmp_path), mesh2, fp)
    assert cached and calls == [(2,)]
    assert again.to_json()["stages"] == first.to_json()["stages"]
    other, cached, _ = cached_or_planned(make(mesh4), str(tmp_path), mesh4, fp)
    assert not cached and other.mesh.shape == (2, 2) and calls == [(2,), (2, 2)]
    _, cached, _ = cached_or_planned(make(mesh2), str(tmp_path), mesh2, "another-model")
    assert not cached, "a plan cached for another fingerprint was reused"
    assert "mesh (2, 2)" in plan_line(other) and "accumulation 1" in plan_line(other)
    assert not [f for f in os.listdir(tmp_path / "plans") if ".tmp" in f]
