"""The whole-step peak on a model the estimate was not developed on (issue 27, item 5).

A Hugging Face Llama with an 8,192-token vocabulary (``heldout_models``' ``small:llama``: width 64, 2
layers, 8 x 64 tokens), compiled on (4,) through ``autoshard.compile`` with and without full
checkpointing + resharding, the planner choosing the placements. Issue 27 measured such models 7-13%
under the estimate. Three causes, each now modelled or removed:

- the estimate: the gradient buckets ``runtime.gradsync`` allocates once were counted only once a
  gradient existed, and the loss's backward peaks before that; cross entropy's backward holds the
  log-probabilities' gradient next to the logits' (``passes.capture.backward_workspace``);
- the measure: torch's ``MemTracker`` held every parameter gradient to the end of the backward, twice
  (``autoshard.testing.tracker_hooks``), so levers seemed to save nothing.

Every rank's estimate must be within 10% of ``MicrostepTracker``'s peak and never more than 5% under it,
and the tracker must agree within 2% with a counter that registers no hooks (``storage_probe``).
"""
from __future__ import annotations

import pytest

from autoshard.testing.memory_heldout import heldout_peaks
from autoshard.testing.ranks import run_ranks

CASES = (("none", 1, "none", False), ("full + reshard", 1, "full", True))


def worker(rank: int, world: int) -> list:
    return heldout_peaks(rank, ["small:llama"], [(4,)], CASES)


@pytest.fixture(scope="module")
def rows() -> list:
    return run_ranks(worker, 4, timeout=900)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_held_out_estimate_is_within_ten_percent_and_never_five_percent_under(rows, case):
    for rank, got in enumerate(rows):
        r, = [r for r in got if r["case"] == case]
        gap = (r["estimated"] - r["tracker"]) / r["tracker"]
        assert -0.05 <= gap <= 0.10, (f"rank {rank}, {case}: measured {r['tracker']:,} vs estimated "
                                      f"{r['estimated']:,.0f} ({gap:+.1%}, {r['phase']})")


def test_the_tracker_agrees_with_a_counter_that_registers_no_hooks(rows):
    for got in rows:
        for r in got:
            assert abs(r["tracker"] - r["bare"]) / r["bare"] <= 0.02, r
