"""Measured profiles: the least-squares fits and the JSON format (write, load, pool, plan with it).
``autoshard profile`` itself is tested in tests/frontdoor/profiling/test_profiling.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.profile_format import (PROFILE_FORMAT, PROFILE_VERSION, Profile, derive_hardware, fit_affine,
                                           fit_latency_bandwidth, held_out_errors, load_profile, merge_profiles)
from autoshard.testing.models import MLP


def test_least_squares_recovers_latency_and_bandwidth():
    rng = np.random.default_rng(0)
    sizes = np.geomspace(4e3, 4e7, 12)
    lat, bw = 50e-6, 2e9
    exact = lat + sizes / bw
    assert fit_latency_bandwidth(sizes, exact) == pytest.approx((lat, bw), rel=1e-9)
    noisy = exact * (1 + 0.03 * rng.standard_normal(sizes.size))  # 3% timing noise
    got_lat, got_bw = fit_latency_bandwidth(sizes, noisy)
    assert got_lat == pytest.approx(lat, rel=0.1) and got_bw == pytest.approx(bw, rel=0.1)
    # a fit that would need a negative latency is clamped to 0 and refitted through the origin
    a, b = fit_affine([1.0, 2.0, 3.0], [0.9, 2.0, 3.1])
    assert a == 0.0 and b == pytest.approx(1.0, rel=0.05)
    # pure latency: no slope, infinite bandwidth
    assert fit_latency_bandwidth([1e3, 1e6], [1e-4, 1e-4]) == (pytest.approx(1e-4), float("inf"))
    with pytest.raises(AutoshardError, match="at least 2"):
        fit_affine([1.0], [1.0])
    with pytest.raises(AutoshardError, match="positive"):
        fit_affine([1.0, 2.0], [1.0, -1.0])


def _section(x_of, truth, xs, held=()):
    samples = [[*x, truth[0] + truth[1] * x_of(x)] for x in xs]
    held_rows = [[*x, (truth[0] + truth[1] * x_of(x)) * 1.1] for x in held]  # 10% slower than the fit says
    a, b = fit_affine([x_of(x) for x in xs], [s[-1] for s in samples])
    return {"samples": samples, "held_out": held_rows, "fit": {"latency_s": a, "seconds_per_unit": b}}


def synthetic_profile() -> dict:
    flops = lambda s: 2.0 * s[0] * s[1] * s[2]  # noqa: E731
    prof = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": "synthetic",
            "machine": {"hostname": "test", "world_size": 4, "devices_per_node": 4,
                        "memory_bytes_per_device": 4e9, "device": "cpu", "backend": "gloo"},
            "matmul": {"dtype": "float32", **_section(flops, (1e-5, 1 / 50e9), [(64,) * 3, (128,) * 3, (256,) * 3],
                                                      [(192,) * 3])},
            "memory": _section(lambda s: s[0], (1e-6, 1 / 20e9), [(1e6,), (1e7,), (1e8,)]),
            "op_overhead": _section(lambda s: s[0], (1e-4, 15e-6), [(20,), (80,)]),
            "collectives": []}
    for kind, n, lat, bw in (("all_reduce", 2, 100e-6, 1e9), ("all_reduce", 4, 250e-6, 1.2e9),
                             ("all_gather", 4, 130e-6, 2e9), ("send_recv", 2, 40e-6, 3e9)):
        prof["collectives"].append({"kind": kind, "n": n, **_section(lambda s: s[0], (lat, 1 / bw),
                                                                     [(4e3,), (4e5,), (4e6,)], [(1e6,)])})
    prof["hardware"] = derive_hardware(prof).to_json()
    return prof


def test_profile_round_trip_and_plan_with_it(tmp_path):
    prof = synthetic_profile()
    hw = derive_hardware(prof)
    assert hw.flops_fp32 == pytest.approx(50e9) and hw.memory_bandwidth == pytest.approx(20e9)
    assert hw.op_overhead_s == pytest.approx(15e-6) and hw.devices_per_node == 4
    assert hw.collective_fit("all_reduce", 4) == pytest.approx((250e-6, 1 / 1.2e9))
    # link bandwidth from the largest all-reduce: 2 * 3/4 / slope; intercepts regressed on steps
    assert hw.intra_node_bandwidth == pytest.approx(1.5 * 1.2e9)
    errs = held_out_errors(prof)
    assert len(errs) == 5 and all(e["error"] == pytest.approx(1 / 1.1 - 1) for e in errs)
    path = tmp_path / "profile.json"
    Profile(prof).save(path)
    assert json.loads(path.read_text())["format"] == PROFILE_FORMAT
    assert load_profile(path).hardware == hw
    assert get_hardware(str(path)) == hw and get_hardware(prof) == hw
    with pytest.raises(AutoshardError, match="full measured profile"):  # Hardware knows only its own fields
        Hardware.from_json(str(path))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = autoshard.plan(MLP(16, 64), 4, example_inputs=(x,), loss_fn=F.mse_loss, example_target=y,
                          hardware=str(path), **autoshard.presets.data_parallel(4))
    # data parallel: the only gradient traffic is one all-reduce of all the model's gradients
    # (a bucket is no larger than the model), priced from the measured n=4 fit, plus one 15 us launch
    # per parameter for the copy into the bucket
    grad_bytes = 4 * (16 * 64 + 64 + 64 * 16 + 16)
    assert plan.solution.time_breakdown["grad_sync"] == pytest.approx(250e-6 + grad_bytes / 1.2e9 + 4 * 15e-6, rel=1e-6)
    assert "held-out" in Profile(prof).summary()
    # pooling two measurements: twice the points; a machine twice as slow the second time lands in between
    slow = json.loads(json.dumps(prof))
    for key in ("matmul", "memory", "op_overhead"):
        slow[key]["samples"] = [[*s[:-1], 2 * s[-1]] for s in slow[key]["samples"]]
    merged = merge_profiles(prof, slow)
    assert len(merged["matmul"]["samples"]) == 6 and len(merged["collectives"]) == 4
    assert 25e9 < Profile(merged).hardware.flops_fp32 < 50e9
    for got, want in zip(Profile(merge_profiles(prof, prof)).hardware.collective_fits, hw.collective_fits):
        assert got[:2] == want[:2] and got[2:] == pytest.approx(want[2:])
    for bad, msg in (({**prof, "format": "x"}, "not an autoshard profile"), ({**prof, "version": 99}, "version"),
                     ({k: v for k, v in prof.items() if k != "memory"}, "lacks the 'memory'")):
        with pytest.raises(AutoshardError, match=msg):
            Profile.from_json(bad)
    with pytest.raises(AutoshardError, match="not found"):
        load_profile(tmp_path / "missing.json")
