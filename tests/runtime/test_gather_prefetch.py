"""Parameter gathers run once per group per pass: the prefetch started for a group is the gather it uses.

GPT on 4 gloo ranks, every block parameter ZeRO-3-stored (so each group call is one flat all-gather),
under checkpointing (full, selective) with and without reshard after forward, and reshard alone. Every
all-gather the runtime issues in a training step is counted (``runtime.collectives``' one entry point)
and compared with what the program's groups call for: one flat gather per fused set of every group in
the forward, and one more per fused set of every group backward needs again (``regathers``: resharded
or recomputed). A prefetch that is started and then thrown away (its group gathered again) shows as
extra gathers. Two steps with an optimizer step between them, so the shards' versions have moved.
"""
from __future__ import annotations

import pytest
import torch

from autoshard.testing.ranks import run_ranks

#: (checkpoint, reshard after forward)
CASES = (("full", True), ("selective", True), ("full", False), ("none", True))


def _fused_sets(group) -> int:
    """The flat gathers one call of ``group`` issues: one per (mesh axes, dtype) of its fused members."""
    return len({(fused[0], r.dtype) for r in group.members if (fused := r.fused_gather()) is not None})


def _expected(gatherer) -> dict:
    forward = sum(_fused_sets(g) for g in gatherer.groups)
    backward = sum(_fused_sets(g) for g in gatherer.groups if g.regathers)
    return {"forward": forward, "backward": backward}


def counting_worker(rank: int, world: int) -> dict:
    from autoshard.runtime import collectives
    from autoshard.runtime.executor import RankProgram
    from autoshard.testing.levers import layouts, policy_levers

    calls = []
    real = collectives._all_gather_single

    def counted(out, src, *args, **kwargs):
        calls.append(src.numel())
        return real(out, src, *args, **kwargs)

    collectives._all_gather_single = counted
    out = {}
    try:
        for lay in layouts(rank, [("gpt", [(4,)])]):
            for ckpt, reshard in CASES:
                rp = RankProgram.of_strategies(lay.captured, lay.strategies, lay.mesh_shape, env=lay.env, model=lay.model,
                                 levers=policy_levers("gpt", 1, ckpt, reshard))
                opt = torch.optim.SGD(rp.parameters(), lr=0.1)
                counts = []
                for step in range(2):
                    inputs, target = lay.batch(8, 100 + step)
                    calls.clear()
                    rp.step(*inputs, target=target)
                    counts.append(len(calls))
                    opt.step()
                    opt.zero_grad()
                out[f"{ckpt}+reshard" if reshard else ckpt] = {"counts": counts, **_expected(rp.gatherer)}
    finally:
        collectives._all_gather_single = real
    return out


@pytest.fixture(scope="module")
def counted():
    return run_ranks(counting_worker, 4, timeout=600)


@pytest.mark.parametrize("case", ["full+reshard", "selective+reshard", "full", "none+reshard"])
def test_each_group_gathers_once_per_pass(counted, case):
    for rank, result in enumerate(counted):
        r = result[case]
        assert r["backward"] > 0, f"{case}: no group is gathered again in backward; the case tests nothing"
        expected = r["forward"] + r["backward"]
        assert r["counts"] == [expected, expected], (
            f"rank {rank} {case}: {r['counts']} all-gathers per step, expected {expected} "
            f"({r['forward']} in the forward + {r['backward']} regathered in backward)")


def test_a_prefetch_matches_the_same_memory_unwritten_and_nothing_else():
    """One process: aliases of the prefetched shards match (a recomputation's new tensor objects);
    a shard written since, another tensor with equal values, or another view of the storage do not."""
    from autoshard.runtime.param_gather import _Pending

    a, b = torch.arange(8.0), torch.ones(2, 3)

    def pending():
        return _Pending((a, b), (a._version, b._version), [])

    assert pending().matches((a, b))
    assert pending().matches((a.detach(), b.detach()))
    assert not pending().matches((a.clone(), b))
    assert not pending().matches((a[1:], b))
    assert not pending().matches((a.view(2, 4), b))
    assert not pending().matches((a,))
    p = pending()
    b.detach().add_(1.0)  # written through an alias after the gather started
    assert not p.matches((b, b)) and not p.matches((a, b))
