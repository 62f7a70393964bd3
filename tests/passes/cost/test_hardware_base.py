"""A hardware JSON builds on a preset ("base") and overrides only what it gives; one with neither a base
nor achievable-rate fields warns that it is priced at datasheet peak (issue 27, item 4)."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.errors import AutoshardError, PeakPricedWarning

PEAKS_ONLY = {"name": "mine", "flops_bf16": 1e15, "flops_fp32": 6e13, "memory_bandwidth": 3e12, "memory_bytes": 8e10,
              "devices_per_node": 8, "intra_node_bandwidth": 4.5e11, "intra_node_latency": 2e-6,
              "inter_node_bandwidth": 5e10, "inter_node_latency": 5e-6}


def test_a_json_on_a_base_is_the_preset_with_only_its_fields_changed(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"base": "a100", "inter_node_bandwidth": 50e9, "inter_node_latency": 4e-6}))
    hw = get_hardware(str(path))
    assert hw == dataclasses.replace(PRESETS["a100"], inter_node_bandwidth=50e9, inter_node_latency=4e-6)
    assert hw.gemm_efficiency == PRESETS["a100"].gemm_efficiency and hw.collective_model == "nccl"
    # a base may be another such JSON, named relative to the file that names it
    (tmp_path / "bigger.json").write_text(json.dumps({"base": "cluster.json", "name": "bigger", "memory_bytes": 40e9}))
    bigger = get_hardware(str(tmp_path / "bigger.json"))
    assert bigger == dataclasses.replace(hw, name="bigger", memory_bytes=40e9)


def test_plan_prices_with_the_overridden_network():
    """Through ``autoshard.plan``: the JSON on a base plans exactly as the preset with that field replaced,
    and differently from the preset itself (the inter-node link is what a (2, 8) mesh's axis 0 uses)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    x = torch.empty(64, 1024, device="meta")
    y = torch.empty(64, 1024, device="meta")

    def priced(hardware):
        plan = autoshard.plan(model, (2, 8), example_inputs=(x,), loss_fn=nn.functional.mse_loss, example_target=y,
                              hardware=hardware, params={"*": ("R", "R")})
        return plan.estimated_step_time

    slow = {"base": "h100", "inter_node_bandwidth": 1e9}
    assert priced(slow) == pytest.approx(priced(dataclasses.replace(PRESETS["h100"], inter_node_bandwidth=1e9)))
    assert priced(slow) > 1.5 * priced("h100")


def test_peaks_only_json_warns_and_the_others_do_not(tmp_path):
    with pytest.warns(PeakPricedWarning, match="priced at peak"):
        get_hardware(dict(PEAKS_ONLY))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_hardware({**PEAKS_ONLY, "gemm_efficiency": 0.7, "memory_efficiency": 0.9})
        get_hardware({"base": "h100", "name": "mine"})
        get_hardware(PRESETS["h100"].to_json())
        get_hardware("a100")


def test_bad_bases_are_named():
    with pytest.raises(AutoshardError, match="unknown hardware base 'tpu'"):
        get_hardware({"base": "tpu"})
    with pytest.raises(AutoshardError, match=r"unknown field\(s\) \['nvlink'\]"):
        get_hardware({"base": "a100", "nvlink": 1})
    with pytest.raises(AutoshardError, match="names a preset"):
        get_hardware({"base": 3})
    with pytest.raises(AutoshardError, match="fraction"):
        get_hardware({"base": "a100", "gemm_efficiency": 1.5})


def test_a_base_that_builds_on_itself_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"base": str(tmp_path / "b.json")}))
    (tmp_path / "b.json").write_text(json.dumps({"base": str(tmp_path / "a.json")}))
    with pytest.raises(AutoshardError, match="builds on itself"):
        get_hardware(str(tmp_path / "a.json"))
