"""``python -m benchmarks.sim --paper --out DIR``: the paper's figures at its sizes
(:mod:`benchmarks.sim.paper`), every system side by side on the figure's GPU profile.

Writes ``DIR/raw.json`` (the runs, in the suite's format), ``DIR/header.json``,
``DIR/report.md`` with a PNG per figure (:mod:`benchmarks.suite.report`, fig. 17's
sustainable rate under :data:`~benchmarks.sim.paper.FIG17_BOUND_S`), and
``DIR/paper.md``: each result the paper reports beside the same ratio simulated.
One simulated run per (workload, system): the simulation is deterministic, so
repeats would repeat it.  As the suite does, fig. 17 stops raising a system's rate
after the first rate it does not sustain.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.sim.driver import simulate_on
from benchmarks.sim.paper import FIG17_BOUND_S, PAPER_FIGURES
from benchmarks.suite.report import (
    PARROT,
    Point,
    build_report,
    compare,
    fig17_max_rates,
    group_runs,
    metrics_for,
    validate_raw,
)

from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim.cost import load_profile

__all__ = ["CLAIMS", "PAPER_SYSTEMS", "claim_lines", "run_paper"]

PAPER_SYSTEMS = (
    "parrot",
    "parrot-no-affinity",
    "parrot-no-deduction",
    "parrot-no-shared-attention",
    "parrot-baseline-latency",
    "parrot-baseline-throughput",
    "request-level-apc",
)
"""Parrot, its ablations and the request-level baselines (``request-level-apc``: the
latency-centric one on engines with vLLM-like automatic prefix caching)."""


def _vs(
    metric_key: str,
    system: str,
    how: str = "max",
    where: Callable[[dict], bool] = lambda p: True,
    each: str | None = None,
) -> Callable[[Sequence[Point]], str]:
    """Parrot against ``system`` on the points ``where`` keeps: the report's ratio of means
    (:func:`benchmarks.suite.report.compare`), aggregated ``how`` ("max" or "geomean") over
    those points, or with ``each`` one ratio per point, labelled ``each=x``."""

    def measure(points: Sequence[Point]) -> str:
        kept = [p for p in points if where(dict(p.params))]
        groups = [[p] for p in kept] if each else [kept] if kept else []
        parts = []
        for group in groups:
            figure = group[0].workload.split("/")[0]
            value = compare(group, figure, system, metric_key, how, FIG17_BOUND_S).value
            if value is not None:
                parts.append(f"{value:.2f}x" + (f" ({each}={group[0].params.get('x')})" if each else ""))
        return ", ".join(parts) or "n/a"

    return measure


def _rates(better: str, worse: str):
    """The ratio of two systems' highest sustainable fig. 17 rates ("at least" when the
    better one sustained the sweep's top rate)."""

    def measure(points: Sequence[Point]) -> str:
        rates = {s: statistics.fmean(r.values()) for s, r in fig17_max_rates(
            points, metrics_for("fig17")[0], FIG17_BOUND_S
        ).items() if r}  # fmt: skip
        top = max((float(p.params["x"]) for p in points), default=0.0)
        a, b = rates.get(better), rates.get(worse)
        if a is None or b is None:
            return "n/a"
        shown = f"{a:g} against {b:g} req/s"
        if b == 0:
            return f"{shown} (the slower sustained no rate)"
        return f"{'at least ' if a >= top else ''}{a / b:.2f}x ({shown})"

    return measure


def _over_bound(run: dict) -> bool:
    """Whether a fig. 17 run's normalised latency is over the bound (or has no value)."""
    value = metrics_for("fig17")[0].fn(run)
    return value is None or value > FIG17_BOUND_S


@dataclass(frozen=True)
class Claim:
    """One result the paper reports and how to read the same ratio off the simulation."""

    figure: str
    what: str
    paper: str
    measure: Callable[[Sequence[Point]], str]


def _on(sweep: str) -> Callable[[dict], bool]:
    return lambda p: p.get("sweep") == sweep or sweep in p.get("also", {})


CLAIMS = (
    Claim(
        "fig11",
        "chain, best output length, vs request-level (vLLM-like)",
        "1.38x",
        _vs("latency_s", "request-level-apc", where=_on("output")),
    ),
    Claim(
        "fig11",
        "chain over chunk sizes, vs request-level (vLLM-like)",
        "~1.2x",
        _vs("latency_s", "request-level-apc", "geomean", _on("chunk")),
    ),
    Claim(
        "fig14",
        "map-reduce, vs latency-centric",
        "2.37x",
        _vs("latency_s", "parrot-baseline-latency", "geomean"),
    ),
    Claim(
        "fig15_16",
        "request latency at batches 8 and 16, vs no sharing",
        "1.8-2.4x",
        _vs("latency_s", "parrot-baseline-latency", where=lambda p: p["x"] in (8, 16), each="batch"),
    ),
    Claim(
        "fig15_16",
        "per output token at batches 32 and 64, vs vLLM-like prefix sharing",
        "1.58x, 1.84x",
        _vs("per_token_s", "request-level-apc", where=lambda p: p["x"] in (32, 64), each="batch"),
    ),
    Claim(
        "fig15_16",
        "request latency, vs Parrot with per-sequence attention",
        "1.1-1.7x (kernel alone)",
        _vs("latency_s", "parrot-no-shared-attention", each="batch"),
    ),
    Claim("fig17", "sustainable rate, vs no sharing", "12x", _rates(PARROT, "parrot-baseline-latency")),
    Claim(
        "fig17",
        "sustainable rate without affinity, vs no sharing",
        "3x",
        _rates("parrot-no-affinity", "parrot-baseline-latency"),
    ),
    Claim(
        "fig17",
        "sustainable rate, vs per-sequence attention",
        "2.4x",
        _rates(PARROT, "parrot-no-shared-attention"),
    ),
    Claim(
        "fig18",
        "multi-agent, best, vs latency-centric",
        "11.7x",
        _vs("latency_s", "parrot-baseline-latency"),
    ),
    Claim(
        "fig18",
        "multi-agent at 16 files, vs throughput-centric",
        "2.45x",
        _vs("latency_s", "parrot-baseline-throughput", where=lambda p: p["x"] == 16),
    ),
    *(
        Claim("fig19", what, paper, _vs(metric, system, each="apps"))
        for what, paper, metric, system in (
            ("chat, vs latency-centric", "5.5x", "chat_per_token_s", "parrot-baseline-latency"),
            ("chat, vs throughput-centric", "1.23x", "chat_per_token_s", "parrot-baseline-throughput"),
            ("map-reduce, vs latency-centric", "3.7x", "mr_jct_s", "parrot-baseline-latency"),
            ("map-reduce, vs throughput-centric", "1.05x", "mr_jct_s", "parrot-baseline-throughput"),
        )
    ),
)


def claim_lines(raw: list[dict]) -> list[str]:
    """A markdown table: each claim of :data:`CLAIMS` whose figure ``raw`` ran, paper beside simulation."""
    grouped = group_runs(validate_raw(raw))
    rows = ["| figure | result | paper | simulated |", "|---|---|---|---|"]
    for claim in CLAIMS:
        if claim.figure in grouped:
            rows.append(
                f"| {claim.figure} | {claim.what} | {claim.paper} | {claim.measure(grouped[claim.figure])} |"
            )
    return rows


def _header(figures: Sequence[str], systems: Sequence[str], seed: int) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "mode": "simulation at the paper's sizes (benchmarks/sim/paper.py)",
        "profiles": {f: PAPER_FIGURES[f].profile for f in figures},
        "latency_caps": {f: PAPER_FIGURES[f].latency_cap for f in figures},
        "systems": list(systems),
        "seed": seed,
        "git_commit": commit,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: no bar
        return None
    return tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)


def run_paper(
    figures: Sequence[str],
    systems: Sequence[str],
    out_dir: Path,
    tokenizer: TextTokenizer,
    *,
    seed: int = 0,
    plots: bool = True,
) -> list[dict]:
    """Simulate ``figures`` at the paper's sizes on every system and write the results to
    ``out_dir`` (see the module docstring); returns the raw runs."""
    plan = [(f, w) for f in figures for w in PAPER_FIGURES[f].workloads(seed)]
    bar = _progress(len(plan) * len(systems))
    raw: list[dict] = []
    stopped: set[str] = set()  # systems past their highest sustainable fig17 rate
    try:
        for figure, workload in plan:
            spec = PAPER_FIGURES[figure]
            profile = load_profile(spec.profile)
            for system in systems:
                if figure == "fig17" and system in stopped:
                    if bar is not None:
                        bar.update(1)
                    continue  # as the suite does: a higher rate would only queue longer
                run = simulate_on(
                    workload, system, profile, tokenizer, seed=seed, latency_cap=spec.latency_cap
                )
                raw.append(asdict(run))
                if figure == "fig17" and _over_bound(raw[-1]):
                    stopped.add(system)
                if bar is not None:
                    bar.set_description(f"{system} {workload.name}")
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    header = _header(figures, systems, seed)
    (out_dir / "raw.json").write_text(json.dumps(raw, indent=1))
    (out_dir / "header.json").write_text(json.dumps(header, indent=1))
    build_report(raw, header, out_dir, plots=plots, fig17_bound_s=FIG17_BOUND_S)
    lines = [
        "# The paper's results beside the simulation at the paper's sizes",
        "",
        "Ratios are the other system's mean over Parrot's (> 1: Parrot is better); fig. 17's are "
        f"ratios of the highest sustainable rates (mean normalised latency <= {FIG17_BOUND_S} s per "
        "output token at that rate and every lower one). Tables and plots: `report.md`.",
        "",
        *claim_lines(raw),
        "",
    ]
    (out_dir / "paper.md").write_text("\n".join(lines))
    return raw
