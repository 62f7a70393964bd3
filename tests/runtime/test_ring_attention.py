"""Ring attention on 4 gloo ranks equals the unsharded ``scaled_dot_product_attention``: forward and the
gradients of q, k and v, causal and not, with grouped-query heads, with a boolean mask and with a
learned float bias (its gradient too), with whole blocks and with query rows tiled, in the
contiguous layout and (causal) the zig-zag one; the zig-zag permutation round-trips. Both block
paths: the fused kernel (masks allowed on it; taken by every case but the learned bias, which must
stay on matmuls) and the matmul path forced for all cases."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.testing.ranks import run_ranks

CASES = {  # name: (Hq, Hkv, causal, mask)
    "plain": (4, 4, False, False),
    "causal": (4, 4, True, False),
    "gqa": (4, 2, False, False),
    "gqa causal": (4, 2, True, False),
    "mask": (2, 2, False, True),
    "causal mask": (2, 2, True, True),
    "learned bias": (4, 2, False, "bias"),
}


def _inputs(hq, hkv, use_mask, seq=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, seq, 8, generator=g)
    k, v = torch.randn(2, hkv, seq, 8, generator=g), torch.randn(2, hkv, seq, 8, generator=g)
    if use_mask == "bias":  # a float mask with a gradient, broadcast over the batch
        mask = torch.randn(1, hq, seq, seq, generator=g)
    elif use_mask:
        mask = torch.rand(2, 1, seq, seq, generator=g) > 0.3
        mask[..., 0] = True  # no query row masked out entirely
    else:
        mask = None
    dout = torch.randn(2, hq, seq, 8, generator=g)
    return q, k, v, mask, dout


def ring_worker(rank: int, world: int, fused: bool = True, dtype: torch.dtype = torch.float32) -> list:
    import torch.distributed as dist
    from autoshard.runtime.collectives import AxisComm
    from autoshard.runtime import ring_attention as ring_module
    from autoshard.runtime import ring_blocks
    ring_blocks.USE_FUSED = ring_blocks.FUSED_MASKS = fused
    kernel_calls = [0]
    block_forward = ring_module.block_forward

    def counted(*args, **kwargs):
        kernel_calls[0] += 1
        return block_forward(*args, **kwargs)
    ring_module.block_forward = counted
    from autoshard.runtime.ring_attention import from_zigzag, ring_attention, to_zigzag
    comm = AxisComm("cp", world, rank, dist.group.WORLD)
    # float64 computes in float64 (exact up to ~1e-15); float32 within its rounding
    atol, rtol = (1e-12, 1e-10) if dtype == torch.float64 else (1e-5, 1e-4)
    failures = []
    cases = [(name, c, "contiguous") for name, c in CASES.items()]
    cases += [(name, c, "zigzag") for name, c in CASES.items() if c[2] and not c[3]]
    cases += [(f"{name} 3-row tiles", c, layout) for name, c, layout in cases]
    for name, (hq, hkv, causal, use_mask), layout in cases:
        name = f"{name} {layout}"
        ring_module.TILE_BYTES = 3 * 4 * 2 * hq * 4 if "tiles" in name else 2 ** 30  # 3 rows x 4-key chunks
        q, k, v, mask, dout = (t if t is None or not t.is_floating_point() else t.to(dtype)
                               for t in _inputs(hq, hkv, use_mask))
        learned = mask is not None and mask.is_floating_point()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        full_mask = mask.clone().requires_grad_() if learned else mask
        want = F.scaled_dot_product_attention(*full, attn_mask=full_mask, is_causal=causal, enable_gqa=hkv != hq)
        want.backward(dout)
        mine = lambda t: t.chunk(world, dim=-2)[rank]  # noqa: E731
        local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
        local_mask = None if mask is None else mask.chunk(world, dim=-2)[rank].clone().requires_grad_(learned)
        kernel_calls[0] = 0
        got, _ = ring_attention(*local, local_mask, causal, None, comm, layout)
        if (kernel_calls[0] > 0) != (fused and not learned):
            failures.append(f"{name} rank {rank}: {kernel_calls[0]} fused kernel calls with fused={fused}")
        got.backward(mine(dout))
        checks = [("output", got, mine(want))] + [(f"grad {n}", t.grad, mine(f.grad))
                                                  for n, t, f in zip("qkv", local, full)]
        if learned:
            checks.append(("grad mask", local_mask.grad, mine(full_mask.grad)))
        for what, a, b in checks:
            if not torch.allclose(a, b, atol=atol, rtol=rtol):
                failures.append(f"{name} rank {rank}: {what} differs by {(a - b).abs().max().item():.3g}")
    x = torch.arange(2 * 16.).view(2, 16, 1)
    zz = to_zigzag(x.chunk(world, dim=-2)[rank], comm)
    h = 16 // (2 * world)
    want = torch.cat([x[:, rank * h:(rank + 1) * h], x[:, (2 * world - 1 - rank) * h:(2 * world - rank) * h]], dim=-2)
    if not torch.equal(zz, want) or not torch.equal(from_zigzag(zz, comm), x.chunk(world, dim=-2)[rank]):
        failures.append(f"rank {rank}: zig-zag permutation holds {zz.flatten().tolist()}, "
                        f"want {want.flatten().tolist()}")
    return failures


def test_ring_attention_equals_unsharded_attention():
    failures = [f for per_rank in run_ranks(ring_worker, 4) for f in per_rank]
    assert not failures, "\n".join(failures)


def test_ring_attention_matmul_path_equals_unsharded_attention():
    failures = [f for per_rank in run_ranks(ring_worker, 4, False) for f in per_rank]
    assert not failures, "\n".join(failures)


def test_ring_attention_float64_stays_float64():
    """The matmul path accumulates in the inputs' own dtype when it is wider than float32: a float64
    model through ring attention agrees with float64 attention to rounding, not to float32's."""
    failures = [f for per_rank in run_ranks(ring_worker, 4, False, torch.float64) for f in per_rank]
    assert not failures, "\n".join(failures)


def bf16_worker(rank: int, world: int) -> list:
    """bfloat16 q, k, v through the fused path (contiguous and zig-zag, causal, grouped-query heads)
    stay within bfloat16 rounding of float32 one-device attention."""
    import torch.distributed as dist
    from autoshard.runtime.collectives import AxisComm
    from autoshard.runtime.ring_attention import ring_attention
    from autoshard.runtime.ring_blocks import block_path
    comm = AxisComm("cp", world, rank, dist.group.WORLD)
    q, k, v, _, dout = _inputs(4, 2, False, seq=32)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want.backward(dout)
    mine = lambda t: t.chunk(world, dim=-2)[rank]  # noqa: E731
    failures = []
    for layout in ("contiguous", "zigzag"):
        local = [mine(t).bfloat16().requires_grad_() for t in (q, k, v)]
        if block_path(*local, None) != "fused":
            failures.append(f"bf16 {layout} rank {rank}: not on the fused path")
        got, _ = ring_attention(*local, None, True, None, comm, layout)
        got.backward(mine(dout).bfloat16())
        for what, a, b in [("output", got, mine(want))] + [(f"grad {n}", t.grad, mine(f.grad))
                                                          for n, t, f in zip("qkv", local, full)]:
            err = (a.float() - b).abs().max().item()
            if not torch.allclose(a.float(), b, atol=5e-2, rtol=2e-2):
                failures.append(f"bf16 {layout} rank {rank}: {what} differs by {err:.3g}")
    return failures


def test_ring_attention_bfloat16_fused_path():
    failures = [f for per_rank in run_ranks(bf16_worker, 4) for f in per_rank]
    assert not failures, "\n".join(failures)
