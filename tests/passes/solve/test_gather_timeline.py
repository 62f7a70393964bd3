"""The gathered-copy peak along the runtime's gather order (``passes.solve.gather_timeline``)."""
from autoshard.passes.solve.gather_timeline import gathered_peak


def test_kept_segments_accumulate_and_the_next_one_is_in_flight():
    # embedding (kept), two blocks kept, head (kept): everything is alive at the last block
    assert gathered_peak([(1, 0, 0), (10, 0, 0), (10, 0, 0), (2, 0, 0)]) == 23


def test_resharding_blocks_hold_two_blocks_at_once():
    blocks = [(0, 10, 10)] * 4
    # forward: the block and the next one in flight; backward: the re-gathered block and the previous one
    assert gathered_peak([(1, 0, 0)] + blocks + [(2, 0, 0)]) == 21  # the head is gathered after the last block
    assert gathered_peak([(1, 0, 0)] + blocks) == 21


def test_a_transient_outside_gather_counts_only_around_its_segment():
    # an embedding read in the forward only (not saved), then resharding blocks
    assert gathered_peak([(0, 50, 0), (0, 10, 10), (0, 10, 10)]) == 60
    assert gathered_peak([(0, 5, 0), (0, 10, 10), (0, 10, 10)]) == 20
