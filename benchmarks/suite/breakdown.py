"""Where an application's time goes: inside the serving system or outside it.

For one app record, *in service* is the length of the union of its calls'
``[start_s, end_s]`` intervals: time during which at least one of its calls
was being served.  Everything else between arrival and the app's end is
*outside*: emulated network delays, the client's own work and, for the
baseline, the gaps between one call's answer and the next call's request (the
paper's Figure 3a splits end-to-end latency the same way).

The two clients record calls differently, and the split reads accordingly:

* baseline: a call runs from the moment its request leaves (after its delay)
  until its answer arrives, so in-service time includes queueing in the server;
* Parrot: a call runs from ``started_at`` to ``finished_at`` of the manager's
  graph, i.e. on an engine; queueing in the manager counts as outside.

Invariant: ``0 <= in_service <= latency`` for every app with at least one
call whose times are finite (intervals are clipped to ``[arrival, end]``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Split", "app_split", "breakdown_lines", "mean_split"]


@dataclass(frozen=True)
class Split:
    latency_s: float
    in_service_s: float

    @property
    def outside_s(self) -> float:
        return self.latency_s - self.in_service_s


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def app_split(app: Mapping[str, Any]) -> Split | None:
    """The split of one app record (a dict as in ``raw.json``); None when it failed or
    has no call with finite times."""
    if app.get("error"):
        return None
    lo, hi = float(app["arrival_s"]), float(app["end_s"])
    spans = []
    for call in app.get("calls") or ():
        a, b = float(call["start_s"]), float(call["end_s"])
        if math.isfinite(a) and math.isfinite(b):
            a, b = max(a, lo), min(b, hi)
            if b > a:
                spans.append((a, b))
    if not spans:
        return None
    return Split(hi - lo, _union_length(spans))


def mean_split(apps: Iterable[Mapping[str, Any]], kinds: Sequence[str] | None = None) -> Split | None:
    """Mean latency and mean in-service time over the apps (of ``kinds``, if given) that have a split."""
    splits = [s for a in apps if kinds is None or a["kind"] in kinds if (s := app_split(a)) is not None]
    if not splits:
        return None
    n = len(splits)
    return Split(sum(s.latency_s for s in splits) / n, sum(s.in_service_s for s in splits) / n)


def breakdown_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A markdown table: per figure and system, mean latency of the non-chat apps over all
    workloads and repeats, split into in service and outside."""
    cells: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        apps = [a for a in run["apps"] if a["kind"] != "chat"]
        cells.setdefault((run["figure"], run["system"]), []).extend(apps)
    rows = []
    for (figure, system), apps in sorted(cells.items()):
        split = mean_split(apps)
        if split is None:
            continue
        share = split.outside_s / split.latency_s if split.latency_s > 0 else 0.0
        rows.append(
            f"| {figure} | {system} | {split.latency_s:.2f} | {split.in_service_s:.2f} | "
            f"{split.outside_s:.2f} | {100 * share:.0f}% |"
        )
    if not rows:
        return []
    return [
        "| figure | system | mean latency (s) | in service (s) | outside (s) | outside share |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
