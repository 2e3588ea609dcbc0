"""The in-service / outside split of an app's latency (benchmarks/suite/breakdown.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.suite.breakdown import Split, app_split, breakdown_lines, mean_split  # noqa: E402


def app(calls: list[tuple[float, float]], *, arrival: float = 0.0, end: float = 10.0, kind: str = "chain"):
    return {
        "app_id": "a",
        "kind": kind,
        "arrival_s": arrival,
        "start_s": arrival,
        "end_s": end,
        "error": None,
        "calls": [{"name": f"c{i}", "start_s": a, "end_s": b} for i, (a, b) in enumerate(calls)],
    }


def test_a_chain_with_gaps_between_calls() -> None:
    # three dependent calls, each after a 0.5 s gap: 3 x 1.5 s in service, 1.5 s + tail outside
    split = app_split(app([(0.5, 2.0), (2.5, 4.0), (4.5, 6.0)], end=6.5))
    assert split == Split(6.5, 4.5)
    assert split.outside_s == pytest.approx(2.0)


def test_overlapping_calls_count_once_and_are_clipped_to_the_app() -> None:
    # parallel maps overlapping, a reduce after them; one span sticks out past the end
    split = app_split(app([(1.0, 3.0), (2.0, 4.0), (1.5, 2.5), (5.0, 9.0)], arrival=0.5, end=8.0))
    assert split == Split(7.5, 3.0 + 3.0)


def test_failed_apps_and_apps_without_times_have_no_split() -> None:
    failed = app([(0.0, 1.0)])
    failed["error"] = "boom"
    assert app_split(failed) is None
    assert app_split(app([(float("nan"), float("nan"))])) is None
    assert mean_split([failed]) is None


def test_table_excludes_chat_apps_and_averages_per_figure_and_system() -> None:
    runs = [
        {
            "figure": "fig11",
            "system": "vllm",
            "apps": [app([(0.0, 4.0)], end=8.0), app([(0.0, 1.0)], end=1.0, kind="chat")],
        },
        {"figure": "fig11", "system": "vllm", "apps": [app([(0.0, 2.0)], end=4.0)]},
        {"figure": "fig11", "system": "parrot", "apps": [app([(0.5, 3.0)], end=3.5)]},
    ]
    assert breakdown_lines(runs)[2:] == [
        "| fig11 | parrot | 3.50 | 2.50 | 1.00 | 29% |",
        "| fig11 | vllm | 6.00 | 3.00 | 3.00 | 50% |",
    ]
    assert breakdown_lines([]) == []
