"""The layout arithmetic the cost model and the runtime share (``passes.layout``)."""
import itertools

import pytest

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.layout.gathers import SegmentKeys, fused_gather, gather_groups
from autoshard.passes.layout.redistribution import R_CODE, encode, plan_redistribute, redistribution_steps
from autoshard.passes.layout.shapes import divides, local_offsets, local_shape, why_not_divisible
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Partial, Replicate, Shard

R, P = Replicate(), Partial()


def test_local_shapes_and_offsets_nest_left_to_right():
    assert local_shape((8, 6), (Shard(0), Shard(0)), (2, 2)) == (2, 6)
    assert local_shape((8, 6), (Shard(-1), Shard(0)), (2, 2)) == (4, 3)  # S(-1): the last dim
    # axis 0 splits dim 0 in halves, axis 1 each half again: coordinate (1, 0) starts at 4
    assert [local_offsets((8, 6), (Shard(0), Shard(0)), (2, 2), c) for c in ((0, 1), (1, 0), (1, 1))] == [
        (2, 0), (4, 0), (6, 0)]
    assert local_offsets((8, 6), (Shard(1), P), (2, 2), (1, 1)) == (0, 3)


def test_uneven_shards_name_the_arithmetic():
    with pytest.raises(PlanFormatError, match=r"dim 0 over axis 0 \(2\) x axis 1 \(2\) = 4 ways, but 6 % 4 = 2"):
        local_shape((6, 4), (Shard(0), Shard(0)), (2, 2))
    with pytest.raises(BatchError, match="input 'x'"):
        local_shape((6, 4), (Shard(0), Shard(0)), (2, 2), error=BatchError, what="input 'x'")
    with pytest.raises(PlanFormatError, match="S.0. on a tensor with 0 dims"):
        local_shape((), (Shard(0),), (2,))
    mesh = Mesh.of((2, 2))
    assert divides((4, 6), (Shard(0), Shard(0)), mesh) and not divides((6, 4), (Shard(0), Shard(0)), mesh)
    assert "does not divide" in why_not_divisible((6, 4), (Shard(0), Shard(0)), mesh)


def test_the_code_and_placement_forms_give_the_same_steps():
    """``plan_redistribute`` (the runtime's entry) is ``redistribution_steps`` (the cost model's) on
    codes, for every placement pair of a 2-D tensor on a 3-axis mesh with a size-1 axis."""
    shape = (2, 1, 2)
    options = [R, P, Shard(0), Shard(1)]
    for src in itertools.product(options, repeat=3):
        for dst in itertools.product(options, repeat=3):
            assert plan_redistribute(src, dst, shape, 2) == redistribution_steps(encode(src), encode(dst), shape)
    assert encode((Shard(1), R, P)) == (1, R_CODE, -2)


def test_fused_gathers_are_one_dim_all_gathers_from_the_last_axis_back():
    assert fused_gather(plan_redistribute((Shard(0), Shard(0)), (R, R), (2, 2))) == ((0, 1), 0)
    assert fused_gather(plan_redistribute((Shard(0), Shard(1)), (R, Shard(1)), (2, 2))) == ((0,), 0)
    assert fused_gather(plan_redistribute((Shard(1), Shard(0)), (R, R), (2, 2))) is None  # two dims
    assert fused_gather(plan_redistribute((Shard(0),), (P,), (2,))) is None
    assert fused_gather(plan_redistribute((Shard(0),), (Shard(0),), (2,))) is None  # nothing to gather
    # an outer axis regroups a nested shard: gathers then a chunk, run one by one, not fused
    assert fused_gather(plan_redistribute((Shard(0), Shard(0)), (R, Shard(0)), (2, 2))) is None


def test_segments_are_block_instances_or_the_runs_between_them():
    keys = SegmentKeys()
    blocks = [None, "h.0", "h.0", None, "h.1", "h.0", None]
    assert [keys.key(b) for b in blocks] == [0, "h.0", "h.0", 1, "h.1", "h.0", 2]
    # a revisited block instance is one group with its first visit, ordered by first reader
    uses = [(5, "h.0", "c"), (0, 0, "a"), (1, "h.0", "b"), (4, "h.1", "d"), (3, 1, "e")]
    assert gather_groups(uses) == [["a"], ["b", "c"], ["e"], ["d"]]
