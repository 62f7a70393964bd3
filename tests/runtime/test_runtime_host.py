"""The cost model's table of what the runtime does around each collective (``passes/cost/runtime_host.py``)
against the ops ``runtime.collectives`` dispatches: the same count besides the call, the same bytes copied.
What the bare ``torch.distributed`` call itself dispatches (gloo's reduce-scatter splits and copies its
result) is part of the call the profile times, so it is counted on a bare call and taken off."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.passes.cost.runtime_host import step_host
from autoshard.testing.ranks import run_ranks

#: (kind, static arguments of raw_step, full per-group bytes B of the call made on a (4, 6, 8) float32 input)
STEPS = (("all_gather", (0,), 2 * 4 * 6 * 8 * 4), ("all_gather", (1,), 2 * 4 * 6 * 8 * 4),
         ("reduce_scatter", (0,), 4 * 6 * 8 * 4), ("reduce_scatter", (2,), 4 * 6 * 8 * 4),
         ("all_reduce", (), 4 * 6 * 8 * 4), ("all_to_all", (1, 2), 2 * 4 * 6 * 8 * 4))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.copied = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "c10d":
            self.ops += 1
            if func.overloadpacket.__name__ == "clone":
                self.copied += out.untyped_storage().nbytes()
        return out


def worker(rank: int, world: int) -> list:
    import torch.distributed as dist

    from autoshard.runtime.collectives import AxisComm, raw_step
    comm = AxisComm("x", world, rank, dist.group.WORLD)
    rows = []
    for kind, static, _ in STEPS:
        x = torch.randn(4, 6, 8)
        with _Count() as count:
            raw_step(x, kind, static, comm)
        rows.append((count.ops - _bare_call_ops(kind, x, world), count.copied))
    return rows


def _bare_call_ops(kind: str, x: torch.Tensor, world: int) -> int:
    """Ops the bare torch.distributed call dispatches on buffers already laid out for it."""
    import torch.distributed as dist

    from autoshard.runtime.collectives import _all_gather_single, _reduce_scatter_single
    flat = x.reshape(-1).clone()
    piece = flat[: flat.numel() // world].clone()
    out_full, out_piece = torch.empty(flat.numel() * world), torch.empty(flat.numel() // world)
    calls = {"all_gather": lambda: _all_gather_single(out_full, flat),
             "reduce_scatter": lambda: _reduce_scatter_single(out_piece, flat),
             "all_reduce": lambda: dist.all_reduce(flat), "all_to_all": lambda: dist.all_to_all_single(piece.clone(), piece)}
    with _Count() as count:
        calls[kind]()
    return count.ops - (1 if kind == "all_to_all" else 0)  # the output's clone is the test's, not the call's


def test_the_cost_models_table_matches_the_runtime():
    got = run_ranks(worker, 2, timeout=120)[0]
    for (kind, static, group_bytes), (ops, copied) in zip(STEPS, got):
        dim = static[0] if static else None
        assert step_host(kind, dim, group_bytes, 2) == (ops, float(copied)), (kind, static, ops, copied)
