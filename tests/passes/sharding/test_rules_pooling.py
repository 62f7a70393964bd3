"""Pooling rules: every claimed strategy reproduces the unsharded op (rule numerics)."""
import pytest
import torch
import torch.nn.functional as F

from autoshard.testing.rule_numerics import check_rule_numerics

CASES = {
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), False),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), True),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, 1), True),
    "max_pool1d": (lambda x: F.max_pool1d(x.flatten(2), 2), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pooling_strategies_match_unsharded(name):
    fn, linear = CASES[name]
    result = check_rule_numerics(fn, (torch.randn(4, 6, 8, 8),))
    assert not result.skipped
    assert {"(S(0))->(S(0))", "(S(1))->(S(1))"} <= result.all_str
    assert ("(P)->(P)" in result.all_str) == linear
    assert result.checked_str == result.all_str
