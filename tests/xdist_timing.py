"""The ``timing`` marker: a test that holds wall-clock time to a bound runs alone.

``scripts/test.sh`` runs the suite on two pytest-xdist workers.  A test marked
``@pytest.mark.timing`` measures wall-clock time (a step, a stall, a TTL, a rate) against a
bound that holds on an otherwise idle process, so under xdist no other test runs beside it:
every test takes a shared lock around its setup, call and teardown, a ``timing`` test the
exclusive one, across the workers of the run (``fcntl.flock`` on files in the run's base
temporary folder, the parent of each worker's own).  A turnstile lock, taken before the
main one and released once it is held, keeps a waiting ``timing`` test from being starved
by the other worker's stream of shared holds.
Without xdist (a plain ``pytest``) nothing is locked: each test runs alone anyway.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "timing: holds wall-clock time to a bound; under xdist no other test runs beside it",
    )
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        # The workers (started after this, with this environment) share the cores: an OpenMP
        # thread waiting at a barrier sleeps instead of spinning on a core that the thread it
        # waits for, or the other worker, needs (spinning made the suite ~1.3x slower on 2 cores).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


@contextmanager
def _alone_or_beside(lock_dir: Path, exclusive: bool) -> Iterator[None]:
    with _flock(lock_dir / "turnstile.lock", fcntl.LOCK_EX):
        fd = os.open(lock_dir / "main.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(fd)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # xdist gives each worker --basetemp=<the run's base temp>/popen-gwN
    basetemp = item.config.option.basetemp
    if not (os.environ.get("PYTEST_XDIST_WORKER") and basetemp):
        return (yield)
    lock_dir = Path(basetemp).parent
    with _alone_or_beside(lock_dir, item.get_closest_marker("timing") is not None):
        return (yield)
