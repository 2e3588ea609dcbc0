"""Where an app's time goes (benchmarks/suite/breakdown.py): network, queueing, prefill, decode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.suite.breakdown import CLOCK_SLACK_S, Split, app_split, breakdown_lines, mean_split  # noqa: E402


def call(start: float, end: float, ready: float | None = None, first: float | None = None) -> dict:
    return {"name": "c", "start_s": start, "end_s": end, "ready_s": ready, "first_token_s": first}


def app(calls: list[dict], *, arrival: float = 0.0, end: float = 10.0, kind: str = "chain", delays: int = 0):
    return {
        "app_id": "a",
        "kind": kind,
        "arrival_s": arrival,
        "start_s": arrival,
        "end_s": end,
        "error": None,
        "calls": calls,
        "delays": delays,
        "delay_s": 0.25 * delays,
    }


def test_a_baseline_chain_with_network_gaps_between_calls() -> None:
    # three dependent requests, each after a 0.5 s delay; 0.5 s to the first token, 1 s of decode
    calls = [call(s, s + 1.5, ready=s, first=s + 0.5) for s in (0.5, 2.5, 4.5)]
    split = app_split(app(calls, end=6.0, delays=3))
    assert split == Split(6.0, outside_s=1.5, prefill_s=1.5, decode_s=3.0, delays=3, delay_s=0.75)


def test_parrot_calls_queue_in_the_manager_and_overlap_by_priority() -> None:
    # two parallel maps (one queued behind the other's prefill), then a reduce
    calls = [
        call(0.5, 3.0, ready=0.5, first=1.0),
        call(1.0, 3.5, ready=0.5, first=1.5),  # queued 0.5-1.0 while the first map prefills
        call(3.5, 5.0, ready=3.5, first=4.0),
    ]
    split = app_split(app(calls, end=5.5, delays=3))
    # 0-0.5 outside, 0.5-1.0 prefill (beats queued), 1.0-3.5 decode (beats the second prefill),
    # 3.5-4.0 prefill, 4.0-5.0 decode, 5.0-5.5 outside (the get's delay)
    assert split == Split(5.5, outside_s=1.0, prefill_s=1.0, decode_s=3.5, delays=3, delay_s=0.75)
    queued = app_split(app([call(2.0, 3.0, ready=0.5, first=2.5)], end=3.0))
    assert queued == Split(3.0, outside_s=0.5, queued_s=1.5, prefill_s=0.5, decode_s=0.5)


def test_the_categories_always_sum_to_the_latency_and_are_clipped() -> None:
    ready = 0.5 - CLOCK_SLACK_S / 2  # a moment before the arrival, as the client read it
    calls = [
        call(1.0, 3.0),
        call(2.0, 4.0, first=2.5),
        call(1.5, 2.5, ready=ready),
        call(5.0, 9.0, first=6.0),
    ]
    split = app_split(app(calls, arrival=0.5, end=8.0))
    assert split is not None
    total = split.outside_s + split.queued_s + split.prefill_s + split.service_s + split.decode_s
    assert total == pytest.approx(split.latency_s) == pytest.approx(7.5)
    assert split.queued_s == pytest.approx(0.5)  # 0.5-1.0 (clipped at the arrival)
    assert split.service_s == pytest.approx(1.0)  # 1.0-2.0: only calls without a first token
    assert split.prefill_s == pytest.approx(0.5 + 1.0)  # 2.0-2.5 (beats service) and 5.0-6.0
    assert split.decode_s == pytest.approx(1.5 + 2.0)  # 2.5-4.0 and 6.0-8.0 (clipped at the end)


def test_failed_apps_and_apps_without_times_have_no_split() -> None:
    failed = app([call(0.0, 1.0)])
    failed["error"] = "boom"
    assert app_split(failed) is None
    assert app_split(app([call(float("nan"), float("nan"))])) is None
    assert mean_split([failed]) is None


def test_table_per_figure_system_and_app_kind() -> None:
    runs = [
        {
            "figure": "fig12a",
            "system": "vllm",
            "apps": [app([call(0.0, 4.0, first=1.0)], end=8.0), app([call(0.0, 1.0)], end=1.0, kind="chat")],
        },
        {"figure": "fig12a", "system": "vllm", "apps": [app([call(0.0, 2.0, first=1.0)], end=4.0)]},
    ]
    lines = breakdown_lines(runs)
    assert lines[2:] == [
        "| fig12a | vllm | chain | 2 | 0 | 6.00 | 3.00 | 0.00 | 1.00 | 2.00 | 0.00 | 0.0 | 0.00 |",
        "| fig12a | vllm | chat | 1 | 0 | 1.00 | 0.00 | 0.00 | 0.00 | 0.00 | 1.00 | 0.0 | 0.00 |",
    ]
    assert breakdown_lines([]) == []


def test_an_app_whose_calls_were_stamped_on_another_clock_is_counted_not_split() -> None:
    """Calls 17 s before the app's arrival (a server clock stepped away from the client's)
    would be clipped into "outside"; such an app is left out of the means and counted."""
    aligned = app([call(1.0, 3.0, ready=0.5, first=1.5)], end=4.0)
    skewed = app([call(-16.0, -14.0, ready=-16.5, first=-15.5)], end=4.0)
    late = app([call(4.0 + 2 * CLOCK_SLACK_S, 6.0)], end=4.0)  # begun after its app ended
    within = app([call(1.0, 6.0, ready=-CLOCK_SLACK_S / 2)], end=4.0)  # may end after it
    assert app_split(skewed) is None and app_split(late) is None
    assert app_split(within) is not None and app_split(aligned) is not None
    lines = breakdown_lines(
        [{"figure": "fig11", "system": "parrot", "apps": [aligned, skewed, late, within]}]
    )
    assert lines[2].startswith("| fig11 | parrot | chain | 2 | 2 | ")
