"""tests/conftest.py's ``--both-tiers`` (what ``.ci/run`` passes): one session runs the fast tier, then the
slow tier, and reports each tier's failures and files apart; without it the session stays the fast tier."""
from __future__ import annotations

import pathlib
import re
import shutil

import pytest

SAMPLE = '''
import pytest

@pytest.mark.slow
def test_slow_fails():
    assert False

@pytest.mark.slow
def test_slow_passes():
    pass

def test_fast_fails():
    assert False

def test_fast_passes():
    pass
'''

INI = """[pytest]
addopts = -q -m 'not slow' -p no:cacheprovider
markers = slow: the slow tier
"""


def _session(tmp_path, capsys, *options) -> str:
    """A session (in this process: torch is already imported) of the suite's conftest on ``SAMPLE``."""
    shutil.copy(pathlib.Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    capsys.readouterr()
    # no:unraisableexception: that plugin ends a session with 5 full gc.collect()s, each a walk of this
    # process's whole heap, which late in a CI session holds millions of objects (18 s for these 2 tests)
    code = pytest.main(["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "--import-mode=importlib",
                        "-p", "no:unraisableexception", "-v", "-v",
                        "--file-durations=5", *options, str(tmp_path)])
    out = capsys.readouterr().out
    assert code == pytest.ExitCode.TESTS_FAILED, out
    return out


def test_both_tiers_run_fast_first_and_report_each_tier(tmp_path, capsys):
    out = _session(tmp_path, capsys, "--both-tiers")
    ran = re.findall(r"::(test_\w+) (?:PASSED|FAILED)", out)
    assert ran == ["test_fast_fails", "test_fast_passes", "test_slow_fails", "test_slow_passes"], out
    assert "fast tier: 2 tests, 1 failed" in out and "slow tier: 2 tests, 1 failed" in out, out
    assert "FAILED (fast tier) test_sample.py::test_fast_fails" in out
    assert "FAILED (slow tier) test_sample.py::test_slow_fails" in out
    assert "slowest 1 fast-tier test files" in out and "slowest 1 slow-tier test files" in out, out


def test_without_it_the_session_is_the_fast_tier(tmp_path, capsys):
    out = _session(tmp_path, capsys)
    assert "test_fast_fails" in out and "test_slow" not in out.replace("deselected", ""), out
    assert "2 deselected" in out and "slow tier" not in out and "slowest 1 fast-tier test files" in out, out
