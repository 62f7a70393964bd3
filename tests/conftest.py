"""Every test starts from the same random state, whatever ran before it in the session, so a test's
inputs (and any random plan it draws without its own seed) are the same on every run and in any order.

``--file-durations=N`` (CI passes it) lists the N test files that took longest, each file's setup, call
and teardown seconds summed over its tests: where the suite's time goes, one line per file.

``--both-tiers`` (CI passes it: one session instead of two, one collection and one forkserver start-up) runs
the slow tier (``-m slow``) too, after every fast test, and reports per tier: each tier's tests, failures
and seconds, each failing test under its tier, and ``--file-durations`` listed per tier.
``python -m pytest tests`` (the README's command) stays the fast tier alone."""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch

TIERS = ("fast", "slow")
#: tier -> file -> seconds (setup + call + teardown of its tests)
_SECONDS_PER_FILE: dict[str, collections.Counter] = {tier: collections.Counter() for tier in TIERS}
_SLOW: set[str] = set()  # node ids of the collected slow tests
_TESTS: dict[str, set] = {tier: set() for tier in TIERS}
_FAILED: dict[str, list] = {tier: [] for tier in TIERS}


def pytest_addoption(parser):
    parser.addoption("--file-durations", type=int, default=0, metavar="N",
                     help="list the N slowest test files (setup + call + teardown of their tests)")
    parser.addoption("--both-tiers", action="store_true", default=False,
                     help="run the fast tier, then the slow tier (-m slow), in this one session; report per tier")


def pytest_configure(config):
    if config.getoption("--both-tiers"):
        config.option.markexpr = ""  # the addopts' -m 'not slow' no longer deselects the slow tier


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _SLOW.update(item.nodeid for item in items if item.get_closest_marker("slow") is not None)
    if config.getoption("--both-tiers"):  # stable: each tier keeps its collection order
        items.sort(key=lambda item: item.nodeid in _SLOW)


def _tier(nodeid: str) -> str:
    return "slow" if nodeid in _SLOW else "fast"


def pytest_runtest_logreport(report):
    tier = _tier(report.nodeid)
    _SECONDS_PER_FILE[tier][report.nodeid.split("::")[0]] += report.duration
    _TESTS[tier].add(report.nodeid)
    if report.failed and report.nodeid not in _FAILED[tier]:
        _FAILED[tier].append(report.nodeid)


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--file-durations")
    both = config.getoption("--both-tiers")
    for tier in TIERS if both and any(_TESTS.values()) else ():  # (nothing ran: --collect-only)
        seconds = sum(_SECONDS_PER_FILE[tier].values())
        terminalreporter.write_sep("=", f"{tier} tier: {len(_TESTS[tier])} tests, {len(_FAILED[tier])} failed, "
                                        f"{seconds:.0f} s")
        for nodeid in _FAILED[tier]:
            terminalreporter.write_line(f"FAILED ({tier} tier) {nodeid}")
    for tier in TIERS:
        files = _SECONDS_PER_FILE[tier]
        if not n or not files:
            continue
        total = sum(files.values())
        terminalreporter.write_sep("=", f"slowest {min(n, len(files))} {tier}-tier test files "
                                        f"(of {len(files)}, {total:.0f} s in all)")
        for path, seconds in files.most_common(n):
            terminalreporter.write_line(f"{seconds:8.2f}s {100 * seconds / total:5.1f}%  {path}")


@pytest.fixture(autouse=True)
def _same_random_state_every_test():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
