"""The public API in one process: plan() on every mesh form, Plan persistence, summary and drawing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.errors import PlanFormatError
from autoshard.testing.models import gpt, mlp


def _plan(mesh, **kw):
    torch.manual_seed(0)
    model, inputs, target, loss_fn = gpt()
    return autoshard.plan(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                          hardware="cpu", **kw)


@pytest.mark.parametrize("mesh", [4, (4,), (2, 2), autoshard.Mesh((2, 2), ("dp", "tp"))])
def test_plan_accepts_every_mesh_form(mesh):
    plan = _plan(mesh)
    shape = autoshard.Mesh.of(mesh).shape
    assert plan.mesh.shape == shape
    model = gpt()[0]
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(plan.param_placements) == names  # tied alias lm_head.weight included
    for pls in plan.param_placements.values():
        assert len(pls) == len(shape)
    assert plan.estimated_step_time > 0 and plan.estimated_memory > 0


def test_plan_accepts_a_device_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed as dist
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        dm = DeviceMesh("cpu", torch.arange(64).reshape(8, 8), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model, inputs, target, loss_fn = gpt()
        with torch.device("meta"):
            meta_model = type(model)(64, 32, 2, 4, 16, True)
        inputs = (torch.empty(64, 16, dtype=torch.long, device="meta"),)
        target = torch.empty(64, 16, dtype=torch.long, device="meta")
        plan = autoshard.plan(meta_model, dm, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                              hardware="h100")
        assert plan.mesh.shape == (8, 8) and plan.mesh.axis_names == ("dp", "tp")
    finally:
        dist.destroy_process_group()


def test_save_and_load_round_trip(tmp_path):
    plan = _plan((2, 2))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(path.read_text())  # plain JSON
    assert data["format"] == "autoshard.plan"
    loaded = autoshard.load_plan(str(path))
    assert loaded.param_placements == plan.param_placements
    assert loaded.estimated_step_time == pytest.approx(plan.estimated_step_time)
    assert {k: str(v) for k, v in loaded.strategies.items()} == {k: str(v) for k, v in plan.strategies.items()}
    # re-attaching to the same model's graph works; to another model it is refused
    reattached = loaded.attach(plan.captured, plan.mesh)
    assert reattached.to_dot() == plan.to_dot() and reattached.to_dot("ops") == plan.to_dot("ops")
    other = autoshard.plan(*mlp()[:1], (2, 2), example_inputs=mlp()[1], loss_fn=mlp()[3],
                           example_target=mlp()[2], hardware="cpu")
    with pytest.raises(PlanFormatError, match="different model"):
        loaded.attach(other.captured, plan.mesh)


def test_load_plan_rejects_non_plans(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        autoshard.load_plan(str(bad))
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PlanFormatError, match="not an autoshard plan"):
        autoshard.load_plan(str(bad))
    pickled = tmp_path / "p.pkl"
    import pickle
    pickled.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(PlanFormatError):
        autoshard.load_plan(str(pickled))


def test_summary_names_placements_and_collectives():
    plan = _plan((2, 2))
    text = plan.summary()
    assert "mesh (2, 2)" in text
    assert "blocks.#.q.weight" in text  # repeated blocks folded
    assert "estimated step time" in text and "estimated memory" in text


def test_dot_draws_ops_placements_and_collectives(tmp_path):
    plan = _plan((2, 2), inputs={0: ("S(0)", "R")}, params={"blocks.*.fc.weight": ("R", "S(0)")})
    dot = plan.to_dot(detail="ops")  # the op-level graph (the default picture is at block level)
    assert dot.startswith("digraph")
    assert "cluster" in dot and "blocks.0" in dot
    assert "dp:S(0)" in dot or "dp:R" in dot
    comm_nodes = [line for line in dot.splitlines() if '"comm_' in line and "label=" in line]
    assert len(comm_nodes) == sum(1 for _ in plan.solution.redistributions)
    if shutil.which("dot"):
        out = plan.render(str(tmp_path / "plan.svg"), detail="ops")
        assert open(out).read().lstrip().startswith("<?xml") or "<svg" in open(out).read()


def test_render_without_dot_writes_dot_text(tmp_path, monkeypatch):
    plan = _plan(4)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        plan.render(str(tmp_path / "p.svg"))
    assert (tmp_path / "p.dot").read_text().startswith("digraph")


def test_unknown_pin_keyword_is_a_clear_error():
    with pytest.raises(TypeError, match="pins are"):
        _plan(4, param={"*": ("R",)})


def test_ops_without_rules_are_listed():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.special.bessel_j0(self.fc(x))

    plan = autoshard.plan(Odd(), 4, example_inputs=(torch.randn(8, 8),), loss_fn=lambda o, t: F.mse_loss(o, t),
                          example_target=torch.randn(8, 8), hardware="cpu")
    assert any("bessel_j0" in op for op in plan.replicated_ops)


def test_front_door_names_survive_importing_every_submodule():
    """``autoshard.plan`` and ``autoshard.compile`` stay the functions after every front-door submodule is
    imported, in a fresh interpreter (no submodule shares a front-door function's name)."""
    import subprocess
    import sys
    code = ("import pkgutil, importlib, inspect, autoshard; "
            "[importlib.import_module('autoshard.' + m.name) for m in pkgutil.iter_modules(autoshard.__path__)]; "
            "assert inspect.isfunction(autoshard.plan), autoshard.plan; "
            "assert inspect.isfunction(autoshard.compile), autoshard.compile; "
            "from autoshard.plans import Plan; assert autoshard.Plan is Plan and Plan.__name__ == 'Plan'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
