"""The gathered-copy peak along the runtime's gather order (``passes.solve.gather_timeline``)."""
from autoshard.passes.solve.gather_timeline import Segment, gathered_peak


def _kept(n):
    return Segment(kept=n, prefetched=n)


def _resharded(n, fused=True):
    return Segment(transient=n, regathered=n, prefetched=n if fused else 0, prefetched_again=n if fused else 0)


def test_kept_segments_accumulate_and_the_next_one_is_in_flight():
    # embedding, two blocks, head, all kept: everything is alive at the last block
    assert gathered_peak([_kept(1), _kept(10), _kept(10), _kept(2)]) == 23


def test_resharding_blocks_hold_two_blocks_at_once():
    blocks = [_resharded(10)] * 4
    # forward: a block and the next one in flight; backward: the re-gathered block and the previous one
    assert gathered_peak([_kept(1)] + blocks + [_kept(2)]) == 21
    assert gathered_peak([_kept(1)] + blocks) == 21


def test_gathers_that_are_not_one_flat_collective_are_not_started_ahead():
    blocks = [_resharded(10, fused=False)] * 4
    assert gathered_peak([_kept(1)] + blocks + [_kept(2)]) == 13  # one block at a time, the head at the end


def test_a_transient_outside_gather_counts_only_around_its_segment():
    # an embedding read in the forward only (not saved), then resharding blocks
    assert gathered_peak([Segment(transient=50, prefetched=50), _resharded(10), _resharded(10)]) == 60
    assert gathered_peak([Segment(transient=5, prefetched=5), _resharded(10), _resharded(10)]) == 20
