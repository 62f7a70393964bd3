"""Every test starts from the same random state, whatever ran before it in the session, so a test's
inputs (and any random plan it draws without its own seed) are the same on every run and in any order.

``--file-durations=N`` (CI passes it) lists the N test files that took longest, each file's setup, call
and teardown seconds summed over its tests: where the suite's time goes, one line per file."""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch

_SECONDS_PER_FILE: collections.Counter = collections.Counter()


def pytest_addoption(parser):
    parser.addoption("--file-durations", type=int, default=0, metavar="N",
                     help="list the N slowest test files (setup + call + teardown of their tests)")


def pytest_runtest_logreport(report):
    _SECONDS_PER_FILE[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--file-durations")
    if not n or not _SECONDS_PER_FILE:
        return
    total = sum(_SECONDS_PER_FILE.values())
    terminalreporter.write_sep("=", f"slowest {min(n, len(_SECONDS_PER_FILE))} test files "
                                    f"(of {len(_SECONDS_PER_FILE)}, {total:.0f} s in all)")
    for path, seconds in _SECONDS_PER_FILE.most_common(n):
        terminalreporter.write_line(f"{seconds:8.2f}s {100 * seconds / total:5.1f}%  {path}")


@pytest.fixture(autouse=True)
def _same_random_state_every_test():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
