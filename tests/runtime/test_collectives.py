"""Collectives and redistribution on 4 gloo ranks, checked against full-tensor references.

One spawn of 4 ranks (mesh (2, 2), joined from RANK/WORLD_SIZE as under torchrun) runs every check
and returns the list of mismatches it found; the test asserts that list is empty on every rank.

Gradient checks follow the convention of passes/spec.py with the objective
``L = sum(G * global_output)`` whose true gradient with respect to the global input is ``G``:
the upstream gradient fed to a local output is its shard of ``G`` on S axes, a summand of it on R
axes (weights w summing to 1) and all of it on P axes; the local input gradient must then be the
shard of ``G`` on S axes, sum to ``G`` over R axes, and equal ``G`` on P axes.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from autoshard.passes.errors import MeshError
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Partial, Replicate, Shard, fmt_placements
from autoshard.runtime import collectives as C
from autoshard.runtime.groups import MeshEnv, broadcast_json, setup_distributed
from autoshard.runtime.layout import shard_tensor
from autoshard.runtime.redistribute import plan_redistribute, redistribute
from autoshard.testing.ranks import run_ranks

R, P = Replicate(), Partial()
W = (0.25, 0.75, 1.5, -1.5)  # summand weights: the first n of them add up to 1 for n = 2 and n = 4


def _w(n: int, k: int) -> float:
    return W[k] if n == 2 else (0.1, 0.2, 0.3, 0.4)[k]


def _full(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _sum_over(x: torch.Tensor, comm) -> torch.Tensor:
    x = x.detach().clone()
    if comm.size > 1:
        dist.all_reduce(x, group=comm.group)
    return x


def _close(bad: list, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        bad.append(f"{what}: got {tuple(got.shape)} want {tuple(want.shape)} max err {err}")


def _check_single_collectives(env: MeshEnv, bad: list) -> None:
    X, G = _full(1, (4, 8, 4)), _full(2, (4, 8, 4))
    for comm in (env.comm(0), env.comm(1), env.comm_for((0, 1))):
        n, k = comm.size, comm.rank
        tag = f"[{comm.name} n={n}]"
        for d in range(3):
            x = X.chunk(n, d)[k].clone().requires_grad_()
            out = C.all_gather(x, d, comm)
            _close(bad, f"{tag} all_gather({d}) forward", out, X)
            out.backward(G * _w(n, k))
            _close(bad, f"{tag} all_gather({d}) backward", x.grad, G.chunk(n, d)[k])

            x = (X * _w(n, k)).requires_grad_()
            out = C.reduce_scatter(x, d, comm)
            _close(bad, f"{tag} reduce_scatter({d}) forward", out, X.chunk(n, d)[k])
            out.backward(G.chunk(n, d)[k])
            _close(bad, f"{tag} reduce_scatter({d}) backward", x.grad, G)

            x = X.clone().requires_grad_()
            out = C.chunk(x, d, comm)
            _close(bad, f"{tag} chunk({d}) forward", out, X.chunk(n, d)[k])
            out.backward(G.chunk(n, d)[k])
            _close(bad, f"{tag} chunk({d}) backward", _sum_over(x.grad, comm), G)
            for j in range(3):
                if j == d:
                    continue
                x = X.chunk(n, d)[k].clone().requires_grad_()
                out = C.all_to_all(x, d, j, comm)
                _close(bad, f"{tag} all_to_all({d}->{j}) forward", out, X.chunk(n, j)[k])
                out.backward(G.chunk(n, j)[k])
                _close(bad, f"{tag} all_to_all({d}->{j}) backward", x.grad, G.chunk(n, d)[k])
        x = (X * _w(n, k)).requires_grad_()
        out = C.all_reduce(x, comm)
        _close(bad, f"{tag} all_reduce forward", out, X)
        out.backward(G * _w(n, k))
        _close(bad, f"{tag} all_reduce backward", x.grad, G)

        x = X.clone().requires_grad_()
        out = C.to_partial(x, comm)
        _close(bad, f"{tag} to_partial forward", _sum_over(out, comm), X)
        out.backward(G)
        _close(bad, f"{tag} to_partial backward", _sum_over(x.grad, comm), G)


def _local(full: torch.Tensor, pls, env: MeshEnv, weighted: tuple) -> torch.Tensor:
    """The rank's piece of ``full`` under ``pls``, scaled by w(coord) on each axis whose placement
    is in ``weighted`` (making a summand there)."""
    coord, shape = env.coordinate, env.mesh.shape
    piece = shard_tensor(full, tuple(R if isinstance(p, Partial) else p for p in pls), shape, coord).clone()
    for a, p in enumerate(pls):
        if type(p) in weighted:
            piece = piece * _w(shape[a], coord[a])
    return piece


def _check_all_pairs(env: MeshEnv, bad: list) -> int:
    X, G = _full(3, (4, 8)), _full(4, (4, 8))
    options = [R, P, Shard(0), Shard(1)]
    pairs = 0
    for src in itertools.product(options, repeat=2):
        for dst in itertools.product(options, repeat=2):
            tag = f"{fmt_placements(src)} -> {fmt_placements(dst)}"
            x = _local(X, src, env, (Partial,)).requires_grad_()
            out = redistribute(x, src, dst, env)
            p_axes = [a for a, p in enumerate(dst) if isinstance(p, Partial)]
            got = _sum_over(out, env.comm_for(p_axes)) if p_axes else out
            _close(bad, f"{tag} forward", got, _local(X, dst, env, ()))
            out.backward(_local(G, dst, env, (Replicate,)))
            r_axes = [a for a, p in enumerate(src) if isinstance(p, Replicate)]
            grad = _sum_over(x.grad, env.comm_for(r_axes)) if r_axes else x.grad
            _close(bad, f"{tag} backward", grad, _local(G, src, env, ()))
            pairs += 1
    return pairs


def _rank_main(rank: int, world: int) -> dict:
    assert not dist.is_initialized()
    env = setup_distributed(Mesh((2, 2)))  # joins from the RANK/WORLD_SIZE environment
    bad: list = []
    _check_single_collectives(env, bad)
    pairs = _check_all_pairs(env, bad)
    # a 3-axis mesh with a size-1 axis: flattened groups over axis subsets
    env3 = setup_distributed(Mesh((2, 1, 2), ("pp", "dp", "tp")))
    one = torch.ones(1, dtype=torch.float64)
    sums = {axes: C.all_reduce(one * (rank + 1), env3.comm_for(axes)).item() for axes in ((0, 2), (0, 1), (2,))}
    c = env3.coordinate
    want = {(0, 2): 10.0, (0, 1): float(sum(r + 1 for r in range(4) if Mesh((2, 1, 2)).coordinate(r)[2] == c[2])),
            (2,): float(sum(r + 1 for r in range(4) if Mesh((2, 1, 2)).coordinate(r)[0] == c[0]))}
    if sums != want:
        bad.append(f"flattened groups on (2, 1, 2): {sums} != {want}")
    plan = broadcast_json({"plan": [1, 2.5, "S(0)"], "rank": rank} if rank == 0 else None, src=0, env=env)
    big = broadcast_json("x" * 100_000 if rank == 1 else None, src=1, env=env)
    return {"bad": bad, "pairs": pairs, "coord": env.coordinate, "plan": plan, "big_ok": big == "x" * 100_000,
            "backend": env.backend, "device": str(env.device)}


def test_collectives_and_all_redistributions_on_4_ranks():
    results = run_ranks(_rank_main, 4, init="env")
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: " + "\n".join(res["bad"][:20])
        assert res["pairs"] == 256
        assert res["coord"] == Mesh((2, 2)).coordinate(rank)
        assert res["plan"] == {"plan": [1, 2.5, "S(0)"], "rank": 0}
        assert res["big_ok"]
        assert (res["backend"], res["device"]) == ("gloo", "cpu")


def test_redistribution_plans_are_minimal_for_common_cases():
    mesh = (2, 2)
    assert plan_redistribute((Shard(0), R), (R, R), mesh) == [_s("all_gather", 0, 0)]
    assert plan_redistribute((P, R), (Shard(1), R), mesh) == [_s("reduce_scatter", 0, 1)]
    assert plan_redistribute((R, Shard(0)), (R, Shard(1)), mesh) == [_s("all_to_all", 1, 0, 1)]
    assert plan_redistribute((R, R), (Shard(0), P), mesh) == [_s("chunk", 0, 0), _s("to_partial", 1)]
    # nested: axis 1 must give up its sub-chunk before axis 0 regroups dim 0
    assert plan_redistribute((Shard(0), Shard(0)), (R, Shard(0)), mesh) == [
        _s("all_gather", 1, 0), _s("all_gather", 0, 0), _s("chunk", 1, 0)]
    # a size-1 axis never communicates
    assert plan_redistribute((Shard(0), P), (R, R), (1, 2)) == [_s("all_reduce", 1)]


def _s(kind, axis, dim=None, dim2=None):
    from autoshard.runtime.redistribute import Step
    return Step(kind, axis, dim, dim2)


def test_mesh_must_match_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(MeshError, match=r"mesh \(2, 2\) has 2\*2 = 4 devices but the world size is 3"):
        setup_distributed((2, 2))


def test_alone_without_environment(monkeypatch):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    env = setup_distributed(1)
    assert not env.distributed and env.coordinate == (0,)
    assert broadcast_json({"a": 1}) == {"a": 1}
    with pytest.raises(MeshError, match="2 devices but the world size is 1"):
        setup_distributed(2)


def test_offline_env_reports_coordinates():
    env = MeshEnv.offline(Mesh((2, 2)), rank=3)
    assert env.coordinate == (1, 1)
    assert (env.comm(1).size, env.comm(1).rank) == (2, 1)
    flat = env.comm_for((0, 1))
    assert (flat.size, flat.rank, flat.name) == (4, 3, "dp_tp")
