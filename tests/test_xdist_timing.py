"""The ``timing`` marker (tests/xdist_timing.py): under two xdist workers, other tests run
side by side, and a ``timing`` test runs with no other test beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each test marks itself running with a file in $PROBE_DIR for as long as it runs.
PROBE = '''
import os, time
from pathlib import Path

import pytest

RUNNING = Path(os.environ["PROBE_DIR"])


def running(me, seconds):
    """Mark ``me`` running for ``seconds``; every other test seen running meanwhile."""
    mine = RUNNING / me
    mine.touch()
    seen = set()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            seen |= {p.name for p in RUNNING.iterdir()} - {me}
            time.sleep(0.01)
    finally:
        mine.unlink()
    return seen


def meet(me, other):
    """Wait (30 s at most) until ``other`` runs at the same time as ``me``."""
    (RUNNING / me).touch()
    try:
        end = time.monotonic() + 30
        while not (RUNNING / other).exists():
            assert time.monotonic() < end, f"{other} never ran beside {me}"
            time.sleep(0.01)
        time.sleep(0.2)  # the other sees this one too
    finally:
        (RUNNING / me).unlink()
'''

FILE = """
from probe import meet, running
import pytest


def test_meet_{me}():
    meet("{me}", "{other}")


@pytest.mark.timing
def test_alone_{me}():
    assert running("timing-{me}", 1.0) == set()


def test_busy_{me}_1():
    running("busy-{me}-1", 0.3)


def test_busy_{me}_2():
    running("busy-{me}-2", 0.3)


@pytest.mark.timing
def test_alone_again_{me}():
    assert running("timing-again-{me}", 0.5) == set()


def test_busy_{me}_3():
    running("busy-{me}-3", 0.3)
"""


def test_timing_tests_run_alone_and_the_others_side_by_side(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "probe.py").write_text(textwrap.dedent(PROBE))
    for me, other in (("a", "b"), ("b", "a")):
        (suite / f"test_{me}.py").write_text(FILE.format(me=me, other=other))
    probe_dir = tmp_path / "running"
    probe_dir.mkdir()
    env = {
        **os.environ,
        "PROBE_DIR": str(probe_dir),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(suite)]),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # xdist is named below; the others cost seconds
    }
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run on a worker
    env.pop("PYTEST_XDIST_TESTRUNUID", None)
    plugins = ["-p", "no:cacheprovider", "-p", "xdist", "-p", "tests.xdist_timing"]
    args = ["-n", "2", "--dist", "loadfile", "--basetemp", str(tmp_path / "base"), "-c", os.devnull]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, *args, "--rootdir", str(suite), str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "12 passed" in done.stdout, done.stdout[-3000:]
