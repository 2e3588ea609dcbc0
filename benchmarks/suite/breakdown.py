"""Where an application's time goes: network, queueing, prefill, decode.

For one app record every instant between its arrival and its end is put in
exactly one category, the first of these that some call of the app is in at
that instant (a call's times are those of :class:`~benchmarks.suite.spec.CallRecord`):

1. ``decode``: from its first token to its end;
2. ``prefill``: from its start to its first token (prefill, and waiting for the
   engine behind other work);
3. ``service``: from its start to its end when the first token's time is
   unknown (a system that reports none);
4. ``queued``: from ready to its start (Parrot: waiting in the manager's queue
   with its inputs present);
5. ``outside``: none of the above: emulated network delays, the client's own
   work and, for the baseline, the gaps between one call's answer and the next
   call's request (the paper's Figure 3a splits end-to-end latency the same way).

The two clients see the server differently, and the split reads accordingly:
the baseline's ``ready == start`` is when its request left, so queueing in the
server shows as ``prefill`` (time to first token); Parrot's calls are placed by
the manager (``queued`` until then) and their ``prefill`` includes waiting in
the engine.  ``delays`` is the number of emulated network delays an app paid
and ``delay_s`` their sum (parallel calls of the baseline pay theirs side by
side, so ``delay_s`` may exceed ``outside``).

Invariant: for every app with a split, the five categories sum to its latency
(intervals are clipped to ``[arrival, end]``).  An app whose calls were stamped on a
clock other than its own (a call ready before the app arrived, or started after it
ended, by more than :data:`CLOCK_SLACK_S`) has no split: clipping would turn the
misplaced time into ``outside``.  The table counts such apps instead.  (A call may
still end after its app: one whose value no output needs.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["CATEGORIES", "CLOCK_SLACK_S", "Split", "app_split", "breakdown_lines", "mean_split", "off_clock"]

CATEGORIES = ("outside", "queued", "prefill", "service", "decode")
_RANK = {
    name: i for i, name in enumerate(("outside", "queued", "service", "prefill", "decode"))
}  # higher wins


@dataclass(frozen=True)
class Split:
    latency_s: float
    outside_s: float = 0.0
    queued_s: float = 0.0
    prefill_s: float = 0.0
    service_s: float = 0.0
    decode_s: float = 0.0
    delays: float = 0.0
    delay_s: float = 0.0

    @property
    def in_service_s(self) -> float:
        return self.prefill_s + self.service_s + self.decode_s


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _intervals(call: Mapping[str, Any]) -> list[tuple[float, float, str]]:
    start, end = _num(call.get("start_s")), _num(call.get("end_s"))
    if start is None or end is None:
        return []
    out = []
    ready, first = _num(call.get("ready_s")), _num(call.get("first_token_s"))
    if ready is not None and ready < start:
        out.append((ready, start, "queued"))
    if first is not None and start <= first <= end:
        out += [(start, first, "prefill"), (first, end, "decode")]
    else:
        out.append((start, end, "service"))
    return out


CLOCK_SLACK_S = 0.05
"""How far (s) a call's times may lie outside its app's span: the client's and the
server's readings of one instant differ by the time an answer takes to arrive."""


def off_clock(app: Mapping[str, Any]) -> bool:
    """Whether some call of ``app`` was ready before the app arrived or started after it
    ended, by more than :data:`CLOCK_SLACK_S`: its times were not on the app's clock."""
    lo, hi = float(app["arrival_s"]), float(app["end_s"])
    for call in app.get("calls") or ():
        stamps = [_num(call.get(k)) for k in ("ready_s", "start_s", "first_token_s", "end_s")]
        known = [t for t in stamps if t is not None]
        if known and (min(known) < lo - CLOCK_SLACK_S or min(known) > hi + CLOCK_SLACK_S):
            return True
    return False


def app_split(app: Mapping[str, Any]) -> Split | None:
    """The split of one app record (a dict as in ``raw.json``); None when it failed,
    has no call with finite times or is :func:`off_clock`."""
    if app.get("error") or off_clock(app):
        return None
    lo, hi = float(app["arrival_s"]), float(app["end_s"])
    spans = []
    for call in app.get("calls") or ():
        for a, b, kind in _intervals(call):
            a, b = max(a, lo), min(b, hi)
            if b > a:
                spans.append((a, b, kind))
    if not spans:
        return None
    cuts = sorted({lo, hi, *(a for a, _, _ in spans), *(b for _, b, _ in spans)})
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for a, b in itertools.pairwise(cuts):
        kinds = [k for s, e, k in spans if s <= a and e >= b]
        totals[max(kinds, key=_RANK.__getitem__) if kinds else "outside"] += b - a
    return Split(
        hi - lo,
        *(totals[c] for c in CATEGORIES),
        delays=float(app.get("delays") or 0),
        delay_s=float(app.get("delay_s") or 0.0),
    )


def mean_split(apps: Iterable[Mapping[str, Any]], kinds: Sequence[str] | None = None) -> Split | None:
    """Field-wise mean of the splits of the apps (of ``kinds``, if given) that have one."""
    splits = [s for a in apps if kinds is None or a["kind"] in kinds if (s := app_split(a)) is not None]
    if not splits:
        return None
    n = len(splits)
    return Split(*(sum(getattr(s, f.name) for s in splits) / n for f in fields(Split)))


def breakdown_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A markdown table: per figure, system and app kind, the mean latency over all
    workloads and repeats and its split (see the module docstring)."""
    cells: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        for app in run["apps"]:
            cells.setdefault((run["figure"], run["system"], app["kind"]), []).append(app)
    rows = []
    for (figure, system, kind), apps in sorted(cells.items()):
        split = mean_split(apps)
        if split is None:
            continue
        n = sum(1 for a in apps if app_split(a) is not None)
        skewed = sum(1 for a in apps if not a.get("error") and off_clock(a))
        rows.append(
            f"| {figure} | {system} | {kind} | {n} | {skewed} | {split.latency_s:.2f} | "
            f"{split.outside_s:.2f} | {split.queued_s:.2f} | {split.prefill_s:.2f} | {split.decode_s:.2f} | "
            f"{split.service_s:.2f} | {split.delays:.1f} | {split.delay_s:.2f} |"
        )
    if not rows:
        return []
    return [
        "| figure | system | apps of kind | apps | left out: off the app's clock | mean latency (s) | "
        "outside: network + client (s) | queued in manager (s) | to first token (s) | decode (s) | "
        "in service, unsplit (s) | delays paid | delay (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
