"""Build the suite's markdown report (tables + PNG plots) from the runner's raw records.

Input: ``raw``, a list of ``dataclasses.asdict(RunRecord)`` dicts (one per
system x workload x repeat, as in ``RESULTS_DIR/raw.json``) and ``header``, a
dict describing the machine and versions (``RESULTS_DIR/header.json``).

Conventions:

* an app's latency is ``end_s - arrival_s``; its per-token (normalised) latency
  is that divided by its output tokens: the ``output_tokens`` of its last-ending
  call record when the system reported it, else ``params["app_output_tokens"]
  [app_id]``, else ``params["output_tokens"]``;
* a run's metric is the mean over the apps it concerns that have no ``error``;
  apps with an ``error`` are counted in the ``errors`` column (and listed), and a
  run whose concerned apps all failed has no value (shown as ``error``);
* per (workload, system): the mean over repeats and the min–max over repeats;
* ``Parrot ×`` compares each other system with the system named ``parrot``:
  for time metrics ``system / parrot`` (Parrot's speedup), for rates
  ``parrot / system``, so > 1 always means Parrot is better.  The value is the
  ratio of the means over repeats; its range is the min–max of the per-repeat
  ratios, pairing runs with the same ``repeat`` index.

Systems whose name starts with ``parrot`` are Parrot and its ablations; the rest are baselines.

Metrics: fig11/fig12a/fig14/fig18 mean latency of the non-chat apps; fig12b mean
and per-app latency; fig15_16 mean request latency and mean per-output-token
latency; fig17 per-rate normalised latency and the highest rate whose mean
(and every lower rate's) stays at or under ``fig17_bound_s``; fig19 chat
normalised latency and map-reduce completion time.

CLI: ``python -m benchmarks.suite.report RESULTS_DIR [--no-plots] [--fig17-bound S]``
rewrites ``RESULTS_DIR/report.md`` (and the PNGs) from ``raw.json`` and ``header.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .breakdown import breakdown_lines

__all__ = [
    "BASELINE",
    "PARROT",
    "TARGETS",
    "Comparison",
    "Metric",
    "Stat",
    "Target",
    "build_report",
    "compare",
    "load_results",
    "main",
    "metrics_for",
]

PARROT = "parrot"
DEFAULT_FIG17_BOUND_S = 0.5

_RUN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "system": str,
    "workload": str,
    "figure": str,
    "params": dict,
    "repeat": int,
    "apps": list,
}
_APP_FIELDS: dict[str, type | tuple[type, ...]] = {
    "app_id": str,
    "kind": str,
    "arrival_s": (int, float),
    "end_s": (int, float),
}
_MAX_LISTED_ERRORS = 20

Run = Mapping[str, Any]

# --------------------------------------------------------------------------- validation


def _check_fields(obj: Any, fields: Mapping[str, type | tuple[type, ...]], where: str) -> None:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    for key, kind in fields.items():
        if key not in obj:
            raise ValueError(f"{where}: missing field {key!r}")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")


def validate_raw(raw: Any) -> list[Run]:
    """Check ``raw`` is a non-empty list of RunRecord-shaped dicts with unique (system, workload, repeat)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("raw results must be a non-empty list of run records")
    seen: set[tuple[str, str, int]] = set()
    for i, run in enumerate(raw):
        _check_fields(run, _RUN_FIELDS, f"raw[{i}]")
        where = f"raw[{i}] ({run['system']}, {run['workload']}, repeat {run['repeat']})"
        for j, app in enumerate(run["apps"]):
            _check_fields(app, _APP_FIELDS, f"{where} apps[{j}]")
        key = (run["system"], run["workload"], run["repeat"])
        if key in seen:
            raise ValueError(f"{where}: duplicate run for this system, workload and repeat")
        seen.add(key)
    return raw


# --------------------------------------------------------------------------- per-app quantities


def app_latency(app: Mapping[str, Any]) -> float:
    """End-to-end latency of one app record: ``end_s - arrival_s``."""
    return float(app["end_s"]) - float(app["arrival_s"])


def app_output_tokens(app: Mapping[str, Any], params: Mapping[str, Any]) -> int | None:
    """Output tokens of a (single-call) app, from its records or else from the workload params."""
    calls = [c for c in app.get("calls") or [] if isinstance(c, Mapping)]
    if calls:
        last = max(calls, key=lambda c: c.get("end_s") or 0.0)
        if isinstance(last.get("output_tokens"), int) and last["output_tokens"] > 0:
            return last["output_tokens"]
    per_app = params.get("app_output_tokens")
    if isinstance(per_app, Mapping) and isinstance(per_app.get(app["app_id"]), int):
        return per_app[app["app_id"]]
    out = params.get("output_tokens")
    return out if isinstance(out, int) and not isinstance(out, bool) and out > 0 else None


def _ok(apps: Iterable[Mapping[str, Any]], kinds: Callable[[str], bool]) -> list[Mapping[str, Any]]:
    return [a for a in apps if kinds(a["kind"]) and not a.get("error")]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _mean_latency(kinds: Callable[[str], bool]) -> Callable[[Run], float | None]:
    def metric(run: Run) -> float | None:
        return _mean([app_latency(a) for a in _ok(run["apps"], kinds)])

    return metric


def _percentile_latency(q: float) -> Callable[[Run], float | None]:
    """The ``q``-quantile (nearest rank) of the run's app latencies."""

    def metric(run: Run) -> float | None:
        values = sorted(app_latency(a) for a in _ok(run["apps"], _any))
        return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else None

    return metric


def _mean_per_token(kinds: Callable[[str], bool]) -> Callable[[Run], float | None]:
    def metric(run: Run) -> float | None:
        values = []
        for app in _ok(run["apps"], kinds):
            tokens = app_output_tokens(app, run["params"])
            if tokens:
                values.append(app_latency(app) / tokens)
        return _mean(values)

    return metric


def _any(kind: str) -> bool:
    return True


def _not_chat(kind: str) -> bool:
    return kind != "chat"


def _is(name: str) -> Callable[[str], bool]:
    return lambda kind: kind == name


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    """One number per run; ``lower_is_better`` decides the direction of ``Parrot ×``."""

    key: str
    label: str  # table caption
    axis: str  # short plot axis label
    fn: Callable[[Run], float | None]
    lower_is_better: bool = True


_TITLES = {
    "fig11": "Figure 11: chain summary of one document",
    "fig12a": "Figure 12a: chain summary under background chat",
    "fig12b": "Figures 12b/13: concurrent chain summaries",
    "fig14": "Figure 14: map-reduce summary",
    "fig15_16": "Figures 15/16: shared system prompt (Bing Copilot)",
    "fig17": "Figure 17: GPTs applications on several engines",
    "fig18": "Figure 18: multi-agent programming",
    "fig19": "Figure 19: chat + map-reduce",
    "app_load": "Mixed application load: chats, chains and map-reduce arriving by a Poisson process",
    "agents_load": "Multi-agent apps arriving by a Poisson process, on a KV pool too small for every prefix",
    "instructed_chain": "Chains whose steps each start with instructions of their own",
}
_APP_LATENCY = Metric(
    "latency_s",
    "mean end-to-end latency of the non-chat apps (s)",
    "E2E latency (s)",
    _mean_latency(_not_chat),
)
_ALL_LATENCY = Metric(
    "latency_s", "mean end-to-end latency of the apps (s)", "latency (s)", _mean_latency(_any)
)
_PER_TOKEN = Metric(
    "per_token_s",
    "mean normalised latency (s per output token)",
    "latency per output token (s)",
    _mean_per_token(_any),
)
_METRICS: dict[str, tuple[Metric, ...]] = {
    "fig11": (_APP_LATENCY,),
    "fig12a": (_APP_LATENCY,),
    "fig12b": (_ALL_LATENCY,),
    "fig14": (_APP_LATENCY,),
    "fig15_16": (_ALL_LATENCY, _PER_TOKEN),
    "fig17": (_PER_TOKEN,),
    "fig18": (_APP_LATENCY,),
    "fig19": (
        Metric(
            "chat_per_token_s",
            "chat: mean normalised latency (s per output token)",
            "chat latency per output token (s)",
            _mean_per_token(_is("chat")),
        ),
        Metric(
            "mr_jct_s",
            "map-reduce: mean completion time (s)",
            "map-reduce completion time (s)",
            _mean_latency(_is("map_reduce")),
        ),
    ),
}


_METRICS["app_load"] = _METRICS["agents_load"] = (
    _ALL_LATENCY,
    Metric(
        "p99_latency_s",
        "p99 end-to-end latency of the apps (s)",
        "p99 latency (s)",
        _percentile_latency(0.99),
    ),
)


def metrics_for(figure: str) -> tuple[Metric, ...]:
    """The metrics reported for ``figure`` (mean app latency for an unknown figure)."""
    return _METRICS.get(figure, (_ALL_LATENCY,))


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stat:
    """Mean and min–max of some values (all ``None`` when there are none)."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat:
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return cls(None, None, None, 0)
        return cls(statistics.fmean(vals), min(vals), max(vals), len(vals))


def _divide(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def parrot_ratio(
    system: Mapping[int, float | None], parrot: Mapping[int, float | None], lower_is_better: bool
) -> Stat:
    """``Parrot ×`` of ``system`` (per-repeat values) against ``parrot``: ratio of means, per-pair range."""
    if not lower_is_better:
        system, parrot = parrot, system
    pairs = [_divide(system[r], parrot[r]) for r in sorted(set(system) & set(parrot))]
    pairs = [p for p in pairs if p is not None]
    mean = _divide(Stat.of(system.values()).mean, Stat.of(parrot.values()).mean)
    if mean is None or not pairs:
        return Stat(mean, None, None, len(pairs))
    return Stat(mean, min(pairs), max(pairs), len(pairs))


def _fmt(value: float | None, missing: str = "—") -> str:
    return missing if value is None else f"{value:.4g}"


def _fmt_range(stat: Stat) -> str:
    return "—" if stat.lo is None else f"{stat.lo:.4g}–{stat.hi:.4g}"


def _fmt_ratio(stat: Stat) -> str:
    return "—" if stat.mean is None else f"{stat.mean:.2f}×"


def _fmt_ratio_range(stat: Stat) -> str:
    return "—" if stat.lo is None else f"{stat.lo:.2f}–{stat.hi:.2f}"


# --------------------------------------------------------------------------- grouping


@dataclass
class Cell:
    """All repeats of one system on one workload."""

    runs: dict[int, Run]

    def values(self, metric: Metric) -> dict[int, float | None]:
        return {r: metric.fn(run) for r, run in self.runs.items()}

    def error_count(self) -> tuple[int, int]:
        apps = [a for run in self.runs.values() for a in run["apps"]]
        return sum(1 for a in apps if a.get("error")), len(apps)


@dataclass
class Point:
    """One workload (one x-axis point of a figure) and its cells by system."""

    workload: str
    params: Mapping[str, Any]
    cells: dict[str, Cell]

    def sort_key(self) -> tuple[float, str]:
        x = self.params.get("x")
        return (float(x) if _is_number(x) else math.inf, self.workload)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def system_order(systems: Iterable[str]) -> list[str]:
    """``parrot`` first, then its ablations, then the baselines, each alphabetically."""
    return sorted(set(systems), key=lambda s: (s != PARROT, not s.startswith(PARROT), s))


def group_runs(runs: Sequence[Run]) -> dict[str, list[Point]]:
    """``{figure: [Point, ...]}``: figures and sweeps in first-seen order, then points by (x, name)."""
    figures: dict[str, dict[str, Point]] = {}
    sweeps: dict[str, int] = {}
    for run in runs:
        points = figures.setdefault(run["figure"], {})
        point = points.setdefault(run["workload"], Point(run["workload"], run["params"], {}))
        point.cells.setdefault(run["system"], Cell({})).runs[run["repeat"]] = run
        sweeps.setdefault(str(run["params"].get("sweep", "")), len(sweeps))

    def key(point: Point) -> tuple[int, float, str]:
        return (sweeps[str(point.params.get("sweep", ""))], *point.sort_key())

    return {fig: sorted(points.values(), key=key) for fig, points in figures.items()}


# --------------------------------------------------------------------------- tables


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def metric_table(points: Sequence[Point], metric: Metric, systems: Sequence[str]) -> list[str]:
    """Markdown rows: workload, x, system, repeats, errors, mean, min–max, Parrot ×, its range."""
    header = ["workload", "x", "system", "repeats", "errors", "mean", "min–max", "Parrot ×", "Parrot × range"]
    rows = []
    for point in points:
        parrot = point.cells.get(PARROT)
        parrot_values = parrot.values(metric) if parrot else None
        for system in systems:
            cell = point.cells.get(system)
            if cell is None:
                continue
            values = cell.values(metric)
            stat = Stat.of(values.values())
            errors, total = cell.error_count()
            ratio = Stat(None, None, None, 0)
            if parrot_values is not None and system != PARROT:
                ratio = parrot_ratio(values, parrot_values, metric.lower_is_better)
            rows.append(
                [
                    point.workload,
                    _fmt(point.params.get("x")) if _is_number(point.params.get("x")) else "",
                    system,
                    str(len(values)),
                    f"{errors}/{total}",
                    _fmt(stat.mean, missing="error"),
                    _fmt_range(stat),
                    "" if system == PARROT else _fmt_ratio(ratio),
                    "" if system == PARROT else _fmt_ratio_range(ratio),
                ]
            )
    return _table(header, rows)


def per_app_latencies(cell: Cell) -> dict[str, dict[int, float | None]]:
    """``{app_id: {repeat: latency or None if it failed}}`` for one cell."""
    out: dict[str, dict[int, float | None]] = defaultdict(dict)
    for r, run in cell.runs.items():
        for app in run["apps"]:
            out[app["app_id"]][r] = None if app.get("error") else app_latency(app)
    return out


def per_app_table(point: Point, systems: Sequence[str]) -> list[str]:
    """fig12b/13: per-app mean latency for each system and ``Parrot ×`` per app."""
    by_system = {s: per_app_latencies(point.cells[s]) for s in systems if s in point.cells}
    apps = sorted({a for lat in by_system.values() for a in lat})
    others = [s for s in by_system if s != PARROT]
    header = ["app", *(f"{s} mean (s)" for s in by_system)]
    if PARROT in by_system:
        header += [f"Parrot × vs {s}" for s in others]
    rows = []
    for app in apps:
        row = [app.rsplit("/", 1)[-1]]
        row += [_fmt(Stat.of(lat.get(app, {}).values()).mean, missing="error") for lat in by_system.values()]
        if PARROT in by_system:
            mine = by_system[PARROT].get(app, {})
            row += [_fmt_ratio(parrot_ratio(by_system[s].get(app, {}), mine, True)) for s in others]
        rows.append(row)
    return _table(header, rows)


def max_rate_under(rate_values: Mapping[float, float | None], bound: float) -> float:
    """Highest rate such that it and every lower rate have a value <= ``bound`` (0.0 if the lowest fails)."""
    best = 0.0
    for rate in sorted(rate_values):
        value = rate_values[rate]
        if value is None or value > bound:
            break
        best = rate
    return best


def fig17_max_rates(points: Sequence[Point], metric: Metric, bound: float) -> dict[str, dict[int, float]]:
    """``{system: {repeat: highest sustainable rate}}`` from the per-rate normalised latencies."""
    per: dict[str, dict[int, dict[float, float | None]]] = defaultdict(lambda: defaultdict(dict))
    for point in points:
        rate = point.params.get("x")
        if not _is_number(rate):
            continue
        for system, cell in point.cells.items():
            for r, value in cell.values(metric).items():
                per[system][r][float(rate)] = value
    return {s: {r: max_rate_under(v, bound) for r, v in reps.items()} for s, reps in per.items()}


def sweep_top(points: Sequence[Point]) -> float | None:
    """The highest rate a fig17 sweep ran (None without numeric rates)."""
    rates = [float(p.params["x"]) for p in points if _is_number(p.params.get("x"))]
    return max(rates, default=None)


def fig17_table(
    max_rates: Mapping[str, Mapping[int, float]],
    systems: Sequence[str],
    bound: float,
    top: float | None = None,
) -> list[str]:
    """One row per system: its highest sustainable rate over repeats and Parrot's ratio to it.

    ``top`` is the highest rate swept: a repeat that sustained it only says the
    system's highest rate is *at least* that, so the last column counts such repeats
    (a ratio involving them is bounded by the sweep, not measured)."""
    header = [
        "system",
        "repeats",
        f"max rate with mean ≤ {bound:g} s/token (req/s)",
        "min–max",
        "Parrot ×",
        "repeats at the sweep's top",
    ]
    parrot = max_rates.get(PARROT)
    rows = []
    for system in systems:
        if system not in max_rates:
            continue
        values = dict(max_rates[system])
        stat = Stat.of(values.values())
        ratio = "" if system == PARROT or parrot is None else _fmt_ratio(parrot_ratio(values, parrot, False))
        at_top = "" if top is None else str(sum(1 for v in values.values() if v >= top))
        rows.append([system, str(len(values)), _fmt(stat.mean), _fmt_range(stat), ratio, at_top])
    return _table(header, rows)


def error_lines(runs: Sequence[Run]) -> list[str]:
    """Bullet lines naming the failed apps (at most a few, then a count)."""
    failed = [(run, app) for run in runs for app in run["apps"] if app.get("error")]
    lines = [
        f"- {run['system']} / {run['workload']} / repeat {run['repeat']} / {app['app_id']}: "
        f"{str(app['error']).splitlines()[0][:200] if str(app['error']) else 'error'}"
        for run, app in failed[:_MAX_LISTED_ERRORS]
    ]
    if len(failed) > _MAX_LISTED_ERRORS:
        lines.append(f"- … and {len(failed) - _MAX_LISTED_ERRORS} more")
    return lines


# --------------------------------------------------------------------------- targets and comparisons

#: The request-level baseline the paper's targets are stated against.
BASELINE = "parrot-baseline-latency"
VLLM = "vllm"


@dataclass(frozen=True)
class Target:
    """``Parrot ×`` against ``against``, aggregated over the figure's points by ``how``
    (``geomean`` or ``best``, of a metric's ratios; ``max_rate``: fig17's highest
    sustainable rates), should be at least ``at_least``."""

    metric: str  # Metric.key, or "max_rate"
    how: str
    at_least: float
    against: str = BASELINE
    note: str = ""


def _vs_vllm(metric: str, how: str = "geomean") -> Target:
    return Target(metric, how, 1.3, VLLM, "every figure against vLLM")


TARGETS: dict[str, tuple[Target, ...]] = {
    "fig11": (
        Target("latency_s", "geomean", 1.2, note="paper ~1.2x over the chunk sweep"),
        Target("latency_s", "best", 1.38, note="paper 1.38x"),
        _vs_vllm("latency_s"),
    ),
    "fig12a": (Target("latency_s", "best", 2.0, note="paper 2.38x"), _vs_vllm("latency_s")),
    "fig12b": (Target("latency_s", "best", 1.5, note="paper 1.68x"), _vs_vllm("latency_s")),
    "fig14": (Target("latency_s", "geomean", 2.0, note="paper 2.37x"), _vs_vllm("latency_s")),
    "fig15_16": (Target("latency_s", "geomean", 2.0, note="paper 1.8-2.4x"), _vs_vllm("latency_s")),
    "fig17": (Target("max_rate", "max_rate", 3.0, note="paper 12x"), _vs_vllm("max_rate", "max_rate")),
    "fig18": (Target("latency_s", "best", 3.0, note="paper 11.7x"), _vs_vllm("latency_s")),
    "fig19": (
        Target("chat_per_token_s", "best", 3.0, note="paper 5.5x"),
        Target("mr_jct_s", "best", 2.0, note="paper 3.7x"),
        _vs_vllm("chat_per_token_s"),
    ),
}


@dataclass(frozen=True)
class Comparison:
    """``Parrot ×`` of one system on one figure: ``value`` from the means over repeats,
    ``per_repeat`` from each repeat's own runs (same aggregation)."""

    system: str
    metric: str
    how: str
    value: float | None
    per_repeat: dict[int, float]

    @property
    def spread(self) -> Stat:
        return Stat.of(self.per_repeat.values())


def _geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(statistics.fmean(math.log(v) for v in vals)) if vals else None


def _aggregate(values: Sequence[float], how: str) -> float | None:
    if not values:
        return None
    return _geomean(values) if how == "geomean" else max(values)


def compare(
    points: Sequence[Point], figure: str, system: str, metric_key: str, how: str, bound: float
) -> Comparison:
    """Parrot against ``system`` on a figure (see :class:`Target` for ``how``)."""
    if how == "max_rate":
        rates = fig17_max_rates(points, metrics_for(figure)[0], bound)
        mine, theirs = rates.get(PARROT, {}), rates.get(system, {})

        def ratio(a: float | None, b: float | None) -> float | None:  # b sustained no rate: inf
            if a is None or b is None or (a == 0 and b == 0):
                return None
            return math.inf if b == 0 else a / b

        pairs = {r: ratio(mine[r], theirs[r]) for r in sorted(set(mine) & set(theirs))}
        value = ratio(Stat.of(mine.values()).mean, Stat.of(theirs.values()).mean)
        return Comparison(system, metric_key, how, value, {r: v for r, v in pairs.items() if v is not None})
    metric = next(m for m in metrics_for(figure) if m.key == metric_key)
    means: list[float] = []
    pairs: list[dict[int, float]] = []  # per point used: repeat -> that repeat's ratio
    for point in points:
        if PARROT not in point.cells or system not in point.cells:
            continue
        theirs, mine = point.cells[system].values(metric), point.cells[PARROT].values(metric)
        ratio = parrot_ratio(theirs, mine, metric.lower_is_better)
        if ratio.mean is None:
            continue
        means.append(ratio.mean)
        one = {r: parrot_ratio({r: theirs[r]}, {r: mine[r]}, metric.lower_is_better).mean for r in theirs}
        pairs.append({r: v for r, v in one.items() if r in mine and v is not None})
    # a repeat counts only if it has a ratio at every point the means used
    repeats = set.intersection(*(set(p) for p in pairs)) if pairs else set()
    per = {r: v for r in sorted(repeats) if (v := _aggregate([p[r] for p in pairs], how)) is not None}
    return Comparison(system, metric_key, how, _aggregate(means, how), per)


def _metric_label(figure: str, key: str) -> str:
    if key == "max_rate":
        return "highest sustainable request rate"
    return next((m.label for m in metrics_for(figure) if m.key == key), key)


def _verdict(value: float | None, target: Target) -> str:
    if value is None:
        return "no data"
    return "met" if value >= target.at_least else "missed"


def _fmt_x(value: float | None) -> str:
    if value is None:
        return "—"
    return "∞" if math.isinf(value) else f"{value:.2f}×"


def _per_repeat(comparison: Comparison) -> str:
    return ", ".join(f"r{r}: {_fmt_x(v)[:-1]}" for r, v in sorted(comparison.per_repeat.items())) or "—"


def _rows_for(figure: str, points: Sequence[Point]) -> list[tuple[str, str]]:
    """(metric key, how) pairs shown for every compared system."""
    if figure == "fig17":
        return [("max_rate", "max_rate"), (metrics_for(figure)[0].key, "geomean")]
    return [(m.key, how) for m in metrics_for(figure) for how in ("geomean", "best")]


def comparison_table(figure: str, points: Sequence[Point], systems: Sequence[str], bound: float) -> list[str]:
    """Parrot against each of ``systems`` (aggregated over the figure's points), with the
    per-repeat ratios and, where the paper's targets apply, whether they are met."""
    rows = []
    targets = TARGETS.get(figure, ())
    for system in systems:
        for key, how in _rows_for(figure, points):
            c = compare(points, figure, system, key, how, bound)
            if c.value is None and not c.per_repeat:
                continue
            spread = c.spread
            goal = next((t for t in targets if (t.against, t.metric, t.how) == (system, key, how)), None)
            rows.append(
                [
                    system,
                    _metric_label(figure, key),
                    {"geomean": "geo. mean over points", "best": "best point", "max_rate": "ratio"}[how],
                    _fmt_x(c.value),
                    _per_repeat(c),
                    "—" if spread.lo is None else f"{spread.lo:.2f}–{spread.hi:.2f}",
                    "" if goal is None else f"≥ {goal.at_least:g}× ({goal.note})",
                    "" if goal is None else _verdict(c.value, goal),
                ]
            )
    header = ["system", "metric", "over the figure", "Parrot ×", "per repeat", "min–max", "target", "met?"]
    return _table(header, rows) if rows else []


def summary_lines(grouped: Mapping[str, Sequence[Point]], bound: float = DEFAULT_FIG17_BOUND_S) -> list[str]:
    """Headline table: per figure (its first metric; fig17 its highest sustainable rate) and
    system other than ``parrot``, ``Parrot ×`` (geometric mean over the figure's points, from
    the means over repeats) with the min–max of the same figure over single repeats, and the
    paper's targets with met/missed."""
    rows = []
    for figure, points in grouped.items():
        systems = [s for s in system_order(s for p in points for s in p.cells) if s != PARROT]
        key, how = ("max_rate", "max_rate") if figure == "fig17" else (metrics_for(figure)[0].key, "geomean")
        cells = []
        for system in systems:
            c = compare(points, figure, system, key, how, bound)
            spread = c.spread
            rng = "" if spread.lo is None else f" ({spread.lo:.2f}–{spread.hi:.2f})"
            cells.append(f"{system}: {_fmt_x(c.value)}{rng}")
        verdicts = []
        for target in TARGETS.get(figure, ()):
            if target.against not in systems:
                continue
            c = compare(points, figure, target.against, target.metric, target.how, bound)
            short = {"geomean": "geo", "best": "best", "max_rate": "rate"}[target.how]
            verdict = f"{_verdict(c.value, target)} ({_fmt_x(c.value)})"
            verdicts.append(f"{target.against} {short} ≥ {target.at_least:g}×: {verdict}")
        if cells:
            rows.append([figure, _metric_label(figure, key), "; ".join(cells), "; ".join(verdicts)])
    if not rows:
        return []
    return _table(["figure", "metric", "Parrot × per system (min–max over repeats)", "targets"], rows)


def load_lines(runs: Sequence[Run], header: Mapping[str, Any]) -> list[str]:
    """The machine's load: before the run, per system during its runs, flagged runs, idle CPU."""
    lines = []
    before = header.get("load_before")
    if isinstance(before, Mapping):
        lines.append(
            f"Before the run: load average {before.get('loadavg')}, machine busy "
            f"{100 * float(before.get('busy_share', 0)):.0f}% over {before.get('seconds')} s."
        )
        lines.append("")
    per: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for run in runs:
        used = (run.get("extra") or {}).get("load")
        if isinstance(used, Mapping):
            per[run["system"]].append(used)
    if per:
        rows = []
        for system in system_order(per):
            loads = per[system]
            wall = sum(u["wall_s"] for u in loads)
            foreign = sum(u["foreign_cpu_s"] for u in loads)
            idle = sum(u["idle_systems_cpu_s"] for u in loads)
            stolen = sum(u.get("steal_cpu_s", 0.0) for u in loads)  # runs recorded before it: none
            peak = max(max(u["loadavg_after"][0], u["loadavg_before"][0]) for u in loads)
            flagged = sum(1 for u in loads if u["flagged"])
            rows.append(
                [system, str(len(loads)), f"{wall:.0f}", f"{foreign:.1f}", f"{idle:.1f}", f"{stolen:.1f}",
                 f"{peak:.2f}", f"{flagged}/{len(loads)}"]
            )  # fmt: skip
        lines += _table(
            [
                "system",
                "runs",
                "wall (s)",
                "CPU of other processes (s)",
                "CPU of the run's idle systems (s)",
                "CPU stolen by the hypervisor (s)",
                "highest 1-min load avg.",
                "flagged runs",
            ],
            rows,
        )
        lines.append("")
    flagged = [
        f"- {run['system']} / {run['workload']} / repeat {run['repeat']}: other processes used "
        f"{100 * run['extra']['load']['foreign_share']:.0f}% of the machine"
        for run in runs
        if isinstance((run.get("extra") or {}).get("load"), Mapping) and run["extra"]["load"]["flagged"]
    ]
    if flagged:
        lines += ["**Flagged runs** (other processes used more than 5% of the machine):", "", *flagged, ""]
    idle = header.get("idle_cpu")
    if isinstance(idle, Mapping) and idle:
        lines.append(
            "Idle CPU of each system after its turns (share of one core; over 5% it was stopped between "
            "turns): " + "; ".join(f"{k}: {', '.join(f'{v:.3f}' for v in vals)}" for k, vals in idle.items())
        )
        lines.append("")
    return lines


# --------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def x_on(params: Mapping[str, Any], sweep: str | None) -> Any:
    """A point's x on ``sweep`` (its own ``x``, or ``also[sweep]`` for a point on two sweeps)."""
    if sweep is None or params.get("sweep") == sweep:
        return params.get("x")
    also = params.get("also")
    return also.get(sweep) if isinstance(also, Mapping) else None


def _series(
    points: Sequence[Point], metric: Metric, system: str, sweep: str | None = None
) -> tuple[list[float], list[Stat]]:
    xs, stats = [], []
    for point in points:
        x = x_on(point.params, sweep)
        if system in point.cells and _is_number(x):
            stat = Stat.of(point.cells[system].values(metric).values())
            if stat.mean is not None:
                xs.append(float(x))
                stats.append(stat)
    return xs, stats


def _lines(
    ax: Any,
    points: Sequence[Point],
    metric: Metric,
    systems: Sequence[str],
    label: str = "",
    sweep: str | None = None,
) -> None:
    for system in systems:
        xs, stats = _series(points, metric, system, sweep)
        if not xs:
            continue
        ys = [s.mean for s in stats]
        err = [[s.mean - s.lo for s in stats], [s.hi - s.mean for s in stats]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{system}{label}")


def _bars(
    ax: Any, groups: Sequence[str], systems: Sequence[str], values: Mapping[str, Sequence[Stat]]
) -> None:
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        stats = values[system]
        xs = [i + k * width for i in range(len(groups))]
        ys = [s.mean or 0.0 for s in stats]
        err = [[(s.mean - s.lo) if s.lo is not None else 0.0 for s in stats],
               [(s.hi - s.mean) if s.hi is not None else 0.0 for s in stats]]  # fmt: skip
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=system)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups, rotation=45 if len(groups) > 6 else 0, fontsize=8)


def _finish_axes(ax: Any, xlabel: str, ylabel: str, title: str = "") -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


_XLABELS = {
    "output": "output length (tokens)",
    "chunk": "chunk size (tokens)",
    "chat_rate": "background chat rate (req/s)",
    "apps": "number of apps",
    "batch": "batch size",
    "rate": "request rate (req/s)",
    "files": "number of files",
}


def _sweeps(points: Sequence[Point]) -> dict[str, list[Point]]:
    """Points by sweep; a point with ``also`` is on each of its sweeps."""
    out: dict[str, list[Point]] = defaultdict(list)
    for point in points:
        out[str(point.params.get("sweep", ""))].append(point)
        also = point.params.get("also")
        for sweep in also if isinstance(also, Mapping) else ():
            out[str(sweep)].append(point)
    return {k: sorted(v, key=lambda p: _xkey(x_on(p.params, k))) for k, v in out.items()}


def _xkey(x: Any) -> float:
    return float(x) if _is_number(x) else math.inf


def _plot_sweeps(plt: Any, figure: str, points: Sequence[Point], systems: Sequence[str]) -> Any:
    """One panel per (sweep, metric): metric vs x, one line per system."""
    panels = [(s, pts, m) for s, pts in _sweeps(points).items() for m in metrics_for(figure)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (sweep, pts, metric) in zip(axes[0], panels, strict=True):
        _lines(ax, pts, metric, systems, sweep=sweep)
        _finish_axes(ax, _XLABELS.get(sweep, sweep or "x"), metric.axis)
    return fig


def _plot_fig15_16(plt: Any, points: Sequence[Point], systems: Sequence[str]) -> Any:
    """Latency and per-token latency vs batch size, one line per (system, output length)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    by_out: dict[Any, list[Point]] = defaultdict(list)
    for point in points:
        by_out[point.params.get("output_tokens")].append(point)
    for ax, metric in zip(axes[0], metrics_for("fig15_16"), strict=True):
        for out, pts in sorted(by_out.items(), key=lambda kv: str(kv[0])):
            _lines(ax, pts, metric, systems, label=f", out={out}")
        _finish_axes(ax, "batch size", metric.axis)
    return fig


def _plot_fig12b(plt: Any, points: Sequence[Point], systems: Sequence[str]) -> Any:
    """Figure 13 style: per-app latency bars for the largest point."""
    point = max(
        points, key=lambda p: max(len(run["apps"]) for c in p.cells.values() for run in c.runs.values())
    )
    present = [s for s in systems if s in point.cells]
    lat = {s: per_app_latencies(point.cells[s]) for s in present}
    apps = sorted({a for v in lat.values() for a in v})
    values = {s: [Stat.of(lat[s].get(a, {}).values()) for a in apps] for s in present}
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(apps) * len(present)), 4))
    _bars(ax, [a.rsplit("/", 1)[-1] for a in apps], present, values)
    _finish_axes(ax, "application", "end-to-end latency (s)", point.workload)
    return fig


def _plot_fig17(plt: Any, points: Sequence[Point], systems: Sequence[str], bound: float) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, points, metrics_for("fig17")[0], systems)
    ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label=f"bound {bound:g} s/token")
    _finish_axes(ax, "request rate (req/s)", "normalised latency (s/token)")
    return fig


def _plot_fig19(plt: Any, points: Sequence[Point], systems: Sequence[str]) -> Any:
    metrics = metrics_for("fig19")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        present = [s for s in systems if any(s in p.cells for p in points)]
        groups = [p.workload.split("/", 1)[-1] for p in points]
        values = {
            s: [Stat.of(p.cells[s].values(metric).values()) if s in p.cells else Stat.of([]) for p in points]
            for s in present
        }
        _bars(ax, groups, present, values)
        _finish_axes(ax, "", metric.axis)
    return fig


def plot_figure(
    figure: str, points: Sequence[Point], systems: Sequence[str], path: Path, bound: float
) -> bool:
    """Write ``path`` (PNG) for ``figure``; False when there is nothing to plot."""
    if not points or not systems:
        return False
    plt = _pyplot()
    if figure == "fig12b":
        fig = _plot_fig12b(plt, points, systems)
    elif figure == "fig15_16":
        fig = _plot_fig15_16(plt, points, systems)
    elif figure == "fig17":
        fig = _plot_fig17(plt, points, systems, bound)
    elif figure == "fig19":
        fig = _plot_fig19(plt, points, systems)
    else:
        fig = _plot_sweeps(plt, figure, points, systems)
    fig.suptitle(_TITLES.get(figure, figure), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- report


def _header_lines(header: Mapping[str, Any]) -> list[str]:
    if not header:
        return ["(no header)"]
    return [
        f"- **{key}**: {value if isinstance(value, str) else json.dumps(value, sort_keys=True)}"
        for key, value in header.items()
    ]


def figure_section(
    figure: str, points: Sequence[Point], out_dir: Path, *, plots: bool, fig17_bound_s: float
) -> list[str]:
    """Markdown for one figure: a table per metric (+ extras), the plot link and the failed apps."""
    systems = system_order(s for p in points for s in p.cells)
    lines = [f"## {_TITLES.get(figure, figure)}", ""]
    if PARROT in systems:
        ablations = [s for s in systems if s != PARROT and s.startswith(PARROT + "-no-")]
        others = [s for s in systems if s != PARROT and s not in ablations]
        table = comparison_table(figure, points, others, fig17_bound_s)
        if table:
            lines += ["**Parrot against each system** (> 1: Parrot is better)", "", *table, ""]
        table = comparison_table(figure, points, ablations, fig17_bound_s)
        if table:
            lines += [
                "**Parrot against its ablations**: what each mechanism brings (ablation / Parrot; "
                "> 1: switching it off costs that much)",
                "",
                *table,
                "",
            ]
    for metric in metrics_for(figure):
        lines += [f"**{metric.label}**", "", *metric_table(points, metric, systems), ""]
    if figure == "fig12b":
        for point in points:
            lines += [f"**per-app latency, {point.workload}**", "", *per_app_table(point, systems), ""]
    if figure == "fig17":
        rates = fig17_max_rates(points, metrics_for("fig17")[0], fig17_bound_s)
        table = fig17_table(rates, systems, fig17_bound_s, sweep_top(points))
        lines += ["**highest sustainable request rate**", "", *table, ""]
    if plots and plot_figure(figure, points, systems, out_dir / f"{figure}.png", fig17_bound_s):
        lines += [f"![{figure}]({figure}.png)", ""]
    failed = error_lines([run for p in points for c in p.cells.values() for run in c.runs.values()])
    if failed:
        lines += ["**failed apps**", "", *failed, ""]
    return lines


def build_report(
    raw: list[dict],
    header: dict,
    out_dir: Path,
    *,
    plots: bool = True,
    fig17_bound_s: float = DEFAULT_FIG17_BOUND_S,
) -> str:
    """Write ``out_dir/report.md`` (and ``out_dir/<figure>.png`` when ``plots``); return the markdown.

    Raises ValueError when ``raw`` is empty or malformed, or ``header`` is not a dict.
    """
    runs = validate_raw(raw)
    if not isinstance(header, Mapping):
        raise ValueError(f"header must be a dict, got {type(header).__name__}")
    if not (fig17_bound_s > 0):
        raise ValueError(f"fig17_bound_s must be > 0, got {fig17_bound_s!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Parrot evaluation suite: results", "", "## Setup", "", *_header_lines(header), ""]
    lines += [
        "Each table gives, per workload and system, the mean over repeats and the min–max over repeats. "
        "`errors` counts failed apps over all repeats (failed apps are left out of the means). "
        "`Parrot ×` is the ratio of means against the system `parrot` (system/parrot for times, "
        "parrot/system for rates, so > 1 means Parrot is better); its range is over per-repeat pairs.",
        "",
    ]
    grouped = group_runs(runs)
    summary = summary_lines(grouped, fig17_bound_s)
    if summary:
        lines += [
            "## Summary",
            "",
            "Parrot × per figure (> 1: Parrot is better): the geometric mean over the figure's points of "
            "the ratio of means over repeats (fig17: the ratio of the highest sustainable rates), with "
            "the same figure computed from each repeat alone as min–max; the targets are the paper's, "
            "against the latency-centric request-level baseline, and 1.3× against vLLM.",
            "",
            *summary,
            "",
        ]
    for figure, points in grouped.items():
        lines += figure_section(figure, points, out_dir, plots=plots, fig17_bound_s=fig17_bound_s)
    split = breakdown_lines(raw)
    if split:
        lines += [
            "## Where the time goes",
            "",
            "Per figure, system and kind of app, over all workloads and repeats: the mean latency, each "
            "instant of it put in the first category that one of the app's calls is in: decode (first "
            "token to end), to first token (prefill and waiting in the engine), in service unsplit (no "
            "first-token time), queued in the manager (Parrot: inputs present, not placed yet), else "
            "outside (emulated network delays, the client, gaps between dependent requests). The "
            "baseline's calls count from the request leaving, so queueing in its server is in 'to first "
            "token'. 'delays paid' is the number of emulated delays per app and 'delay (s)' their sum "
            "(the baseline's parallel calls pay theirs side by side). See `benchmarks/suite/breakdown.py`.",
            "",
            *split,
            "",
        ]
    machine = load_lines(runs, header)
    if machine:
        lines += ["## Machine load", "", *machine]
    text = "\n".join(lines).rstrip() + "\n"
    (out_dir / "report.md").write_text(text, encoding="utf-8")
    return text


def load_results(results_dir: Path) -> tuple[list[dict], dict]:
    """``(raw, header)`` from ``results_dir/raw.json`` and ``results_dir/header.json`` (header optional)."""
    raw_path = Path(results_dir) / "raw.json"
    if not raw_path.is_file():
        raise ValueError(f"{raw_path} not found")
    try:
        raw = json.loads(raw_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{raw_path}: not valid JSON ({exc})") from exc
    header_path = Path(results_dir) / "header.json"
    header = json.loads(header_path.read_text(encoding="utf-8")) if header_path.is_file() else {}
    return raw, header


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Rebuild RESULTS_DIR/report.md from raw.json and header.json."
    )
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--fig17-bound", type=float, default=DEFAULT_FIG17_BOUND_S, help="s per output token")
    args = parser.parse_args(argv)
    try:
        raw, header = load_results(args.results_dir)
        build_report(raw, header, args.results_dir, plots=not args.no_plots, fig17_bound_s=args.fig17_bound)
    except ValueError as exc:
        parser.error(str(exc))
    print(args.results_dir / "report.md")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
