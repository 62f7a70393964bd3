"""``MicrostepTracker`` and torch's ``MemTracker`` measure what a step keeps (``MemTracker`` saw every
parameter gradient twice to the end of the backward while the runtime copied gradients into their
all-reduce buckets; they accumulate there now)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.testing.ranks import run_ranks


def worker(rank: int, world: int) -> dict:
    import autoshard
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoshard.testing.memory_estimates import MicrostepTracker
    from autoshard.testing.storage_probe import StorageProbe, storage_key

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))  # weights >> activations
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    cm = autoshard.compile(model, (2,), example_inputs=(x,), loss_fn=nn.functional.mse_loss, example_target=y,
                           hardware="cpu", params={"*": ("R",)})
    optimizer = torch.optim.AdamW(cm.parameters(), lr=1e-3)

    def step():
        cm.step(x, target=y)
        optimizer.step()
    step()
    state = (list(cm.local_module.parameters()) + list(cm.local_module.buffers())
             + [v for s in optimizer.state.values() for v in s.values()])
    known = {storage_key(t): t.untyped_storage().nbytes() for t in state}
    optimizer.zero_grad()
    with StorageProbe(known) as probe:
        step()
    out = {"bare": probe.peak + sum(known.values()), "grads": sum(p.numel() * 4 for p in cm.parameters())}
    from runtime.local_module import GRAD_BUCKET_PREFIX
    out["buckets"] = sum(b.numel() * b.element_size() for n, b in cm.local_module.named_buffers()
                         if n.startswith(GRAD_BUCKET_PREFIX))
    for name, kind in (("tracker", MicrostepTracker), ("torch", MemTracker)):  # torch's last: its hooks stay
        optimizer.zero_grad()
        tracker = kind()
        tracker.track_external(cm.local_module, optimizer)
        with tracker:
            step()
        out[name] = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    return out


@pytest.fixture(scope="module")
def rank_results() -> list:
    return run_ranks(worker, 2, timeout=300)


def test_microstep_tracker_holds_no_gradient_a_step_frees(rank_results):
    for got in rank_results:
        assert abs(got["tracker"] - got["bare"]) <= 0.02 * got["bare"], got
        # torch's tracker held every gradient twice at the peak while autograd's gradient and its bucket copy
        # were both alive (2026-11-27: +10%, a 512 KiB weight's); gradients now accumulate in their buckets
        # (runtime/gradsync.py), so it agrees too (2026-11-29: +0.5%)
        assert abs(got["torch"] - got["bare"]) <= 0.02 * got["bare"], got


def test_local_module_holds_the_gradient_buckets_from_the_start(rank_results):
    """Every parameter is replicated over the 2 ranks, so every gradient is all-reduced from a bucket
    the runtime allocates once; ``cm.local_module`` registers them so a tracker counts them from the
    first op (``runtime/local_module.py``)."""
    for got in rank_results:
        assert got["grads"] <= got["buckets"] <= got["grads"] + 4096, got  # + each bucket's alignment padding
