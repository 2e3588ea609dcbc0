"""The order in which the test files reach the xdist workers: the longest first.

``scripts/test.sh`` hands whole files to two workers (``--dist loadfile``), in the order of
the collection (``--no-loadscope-reorder``; xdist would otherwise put the files with the
most tests first, whatever they cost).  A few files take tens of seconds (real servers and
engines as processes, the fuzzers), and one of them drawn last kept one worker busy alone
for 10-15 s at the end of a run; given first, the short files fill in around them.

The cost of each file is read from ``tests/file_seconds.json`` (seconds, summed over the
file's tests, from one run on the 2-core machine); a file it does not know yet counts as
one second.  ``--record-file-seconds`` rewrites it from the run that gets it (run the whole
suite).  Only the order changes: every test runs, and a file's tests keep their order.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")
UNKNOWN_FILE_SECONDS = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-seconds",
        action="store_true",
        help=f"write each test file's summed test time to {SECONDS_FILE.name} at the end of the run",
    )


def file_seconds() -> dict[str, float]:
    try:
        data = json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """``items`` with the files in decreasing cost; a stable sort, so each file's tests keep
    their order, and files of equal cost keep theirs."""

    def cost(item: pytest.Item) -> float:
        return -seconds.get(item.nodeid.split("::", 1)[0], UNKNOWN_FILE_SECONDS)

    return sorted(items, key=cost)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, file_seconds())


class _Recorder:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((k, round(v, 1)) for k, v in self.seconds.items()), key=lambda kv: -kv[1]))
        SECONDS_FILE.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    # Recorded where the reports arrive: in the controller under xdist, else in the process.
    if config.getoption("record_file_seconds") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_Recorder(), "parrot-file-seconds")
