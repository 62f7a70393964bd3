"""The fused kernel's calls for one ring step (``runtime.ring_blocks.fused_calls``) cover exactly the
(query, key) pairs causal attention lets through, each once; zig-zag steps off the diagonal are one
whole-block call, diagonal pieces causal calls, and nothing needs an explicit mask there. Which block
path a ring takes (``block_path``)."""
from __future__ import annotations

import torch

from autoshard.runtime import ring_blocks
from autoshard.runtime.ring_blocks import block_path, fused_calls


def _ranges(j, n, length, zigzag):  # (local offset, global start, length), as the ring lays chunks out
    if not zigzag:
        return [(0, j * length, length)]
    h = length // 2
    return [(0, j * h, h), (h, (2 * n - 1 - j) * h, h)]


def _covered(calls, q_ranges, k_ranges):
    """Global (query, key) pairs the calls compute, with multiplicity."""
    qpos = {r0 + a: qs + a for r0, qs, ql in q_ranges for a in range(ql)}
    kpos = {c0 + a: ks + a for c0, ks, kl in k_ranges for a in range(kl)}
    pairs = []
    for c in calls:
        for r in range(c.rows.start, c.rows.stop):
            for col in range(c.cols.start, c.cols.stop):
                a, b = r - c.rows.start, col - c.cols.start
                if c.is_causal and b > a:
                    continue
                if c.keep is not None and not bool(c.keep[a, b]):
                    continue
                pairs.append((qpos[r], kpos[col]))
    return pairs


def test_zigzag_calls_cover_the_causal_pairs_once():
    n, length = 4, 6
    for i in range(n):
        for j in range(n):
            q_ranges, k_ranges = _ranges(i, n, length, True), _ranges(j, n, length, True)
            calls = fused_calls(q_ranges, k_ranges, True, False, "cpu")
            got = _covered(calls, q_ranges, k_ranges)
            want = [(q, k) for _, qs, ql in q_ranges for q in range(qs, qs + ql)
                    for _, ks, kl in k_ranges for k in range(ks, ks + kl) if k <= q]
            assert sorted(got) == sorted(want), (i, j)
            assert all(c.keep is None for c in calls), (i, j)
            assert len(calls) == (1 if i != j else 3), (i, j, calls)


def test_contiguous_calls_cover_causal_and_unequal_lengths():
    for causal in (False, True):
        for lq, lk in ((8, 8), (6, 4)):
            for i in range(3):
                for j in range(3):
                    q_ranges, k_ranges = _ranges(i, 3, lq, False), _ranges(j, 3, lk, False)
                    calls = fused_calls(q_ranges, k_ranges, causal, False, "cpu")
                    want = [(q, k) for q in range(i * lq, (i + 1) * lq) for k in range(j * lk, (j + 1) * lk)
                            if not causal or k <= q]
                    assert sorted(_covered(calls, q_ranges, k_ranges)) == sorted(want), (causal, lq, lk, i, j)
    with_mask = fused_calls(_ranges(1, 3, 4, False), _ranges(1, 3, 4, False), True, True, "cpu")
    assert [c.is_causal for c in with_mask] == [False] and with_mask[0].keep is not None  # merged with the mask


def test_block_path(monkeypatch):
    q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    assert block_path(q, kv, kv, None) == "fused"
    assert block_path(q, kv, kv, torch.ones(8, 8, dtype=torch.bool)) == "matmul"  # masks: FUSED_MASKS off
    monkeypatch.setattr(ring_blocks, "FUSED_MASKS", True)
    assert block_path(q, kv, kv, torch.ones(8, 8, dtype=torch.bool)) == "fused"
    assert block_path(q, kv, kv, torch.zeros(1, 4, 8, 8)) == "fused"
    assert block_path(q, kv, kv, torch.zeros(1, 4, 8, 8, requires_grad=True)) == "matmul"  # learned bias
    assert block_path(q.double(), kv.double(), kv.double(), None) == "matmul"
    assert block_path(q[0], kv[0], kv[0], None) == "matmul"  # the kernel takes 4-d only
