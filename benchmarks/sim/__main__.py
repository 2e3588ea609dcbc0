"""``python -m benchmarks.sim``: the suite's workloads on simulated engines, side by side.

Prints, per workload, each system's mean app latency (virtual seconds) and the ratio
of each system's to the first's, and writes the runs as JSON (``--out``).  Runs are
deterministic: the same arguments give the same numbers.  ``--repeats N`` runs each
workload N times with the suite's seeds (repeat r: ``seed + r``, its arrivals and
lengths drawn anew), so that a simulated mean stands beside a real run's mean over
the same draws.

``--paper --out FOLDER`` runs the paper's figures at the paper's sizes on GPU profiles
instead (:mod:`benchmarks.sim.paper_run`).

``--compare RAW`` (a real run's ``raw.json`` from ``python -m benchmarks.suite``)
also prints, per workload and system, the real mean app latency (the mean over its
repeats of the mean over apps, chats left out as the suite's figures do) beside the
simulated one (the same mean over the simulated repeats) with their relative error,
and per figure and system the mean and largest absolute error: the simulator's
validation table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from benchmarks.sim.driver import SYSTEMS, simulate_on
from benchmarks.sim.paper import PAPER_FIGURES
from benchmarks.sim.paper_run import PAPER_SYSTEMS, run_paper
from benchmarks.suite.workloads import FIGURES, generate

from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim.cost import PROFILES, load_profile


def _tokenizer(name: str) -> TextTokenizer:
    if name == "tiny":
        return TextTokenizer.byte_level_tiny()
    from parrot.engine.loader import load_model

    return load_model(name).tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim", description=__doc__)
    parser.add_argument("--figures", nargs="+", default=["fig11", "fig14"], choices=[*FIGURES, "all"])
    parser.add_argument(
        "--systems", nargs="+", default=["parrot", "parrot-baseline-latency"], choices=list(SYSTEMS)
    )
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=1,
        help="run each workload this many times, repeat r with seed + r as the suite does; a "
        "workload's figure is the mean over its repeats",
    )
    parser.add_argument(
        "--cost",
        default="smollm2-bf16-xeon2",
        help=f"the engines' step cost and KV size: one of {', '.join(PROFILES)}, or a cost JSON file "
        "(python -m benchmarks.sim.calibrate)",
    )
    parser.add_argument("--tokenizer", default="smollm2", help="'smollm2' (default) or 'tiny'")
    parser.add_argument("--latency-cap", type=int, default=None, help="the managers' latency cap (tokens)")
    parser.add_argument(
        "--pack-latency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the managers' latency packing (parrot serve --[no-]pack-latency; default on, as the server's)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=_positive,
        default=None,
        help="every engine's KV pool in tokens, in place of the profile's (the suite's option of that name)",
    )
    parser.add_argument(
        "--app-load-rates",
        type=float,
        nargs="+",
        default=None,
        metavar="RATE",
        help="app_load's arrival rates (apps/s) in place of its default sweep (as the suite's option)",
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="each app alone on a fresh system (the suite's --isolated): the latency floor under load",
    )
    parser.add_argument("--out", type=Path, default=None, help="write every run as JSON here")
    parser.add_argument(
        "--compare", type=Path, default=None, metavar="RAW", help="a real run's raw.json to compare against"
    )
    parser.add_argument(
        "--paper",
        action="store_true",
        help="the paper's figures at its sizes on its GPUs (benchmarks/sim/paper.py); --out is then a "
        "folder for raw.json, report.md, PNGs and paper.md (the paper's results beside the simulated)",
    )
    args = parser.parse_args(argv)
    if args.paper:
        return _paper(parser, args, argv)
    figures = list(FIGURES) if "all" in args.figures else args.figures
    if args.app_load_rates is not None and "app_load" not in figures:
        parser.error("--app-load-rates needs the figure app_load")
    tokenizer = _tokenizer(args.tokenizer)
    try:
        profile = load_profile(args.cost)
    except ValueError as exc:
        parser.error(str(exc))
    runs = []
    header = f"{'workload':40s} " + " ".join(f"{s:>26s}" for s in args.systems)
    print(header)
    for figure in figures:
        try:
            per_repeat = [
                generate(figure, args.scale, args.seed + r, app_load_rates=args.app_load_rates)
                for r in range(args.repeats)
            ]
        except ValueError as exc:
            parser.error(str(exc))
        for repeats in zip(*per_repeat, strict=True):
            workload = repeats[0]
            means = []
            for system in args.systems:
                repeat_means = []
                for r, repeat in enumerate(repeats):
                    run = simulate_on(
                        repeat,
                        system,
                        profile,
                        tokenizer,
                        seed=args.seed + r,
                        repeat=r,
                        latency_cap=args.latency_cap,
                        pack_latency=args.pack_latency,
                        kv_cache_tokens=args.kv_cache_tokens,
                        isolated=args.isolated,
                    )
                    runs.append(run)
                    repeat_means.append(_app_mean(a.latency_s for a in run.apps if a.error is None))
                means.append(statistics.fmean(repeat_means))
            cells = [f"{m:9.2f} s ({m / means[0] if means[0] else float('nan'):5.2f}x)" for m in means]
            print(f"{workload.name:40s} " + " ".join(f"{c:>26s}" for c in cells), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    if args.compare is not None:
        per_run: dict[tuple[str, str], list[float]] = {}
        for r in runs:
            mean = _app_mean(a.latency_s for a in r.apps if _counted(a))
            per_run.setdefault((r.workload, r.system), []).append(mean)
        simulated = {key: statistics.fmean(means) for key, means in per_run.items()}
        print_comparison(_real_means(args.compare), simulated)
    return 0


def _paper(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--paper``: every figure of :data:`~benchmarks.sim.paper.PAPER_FIGURES` (or those
    named), on :data:`~benchmarks.sim.paper_run.PAPER_SYSTEMS` (or those named)."""
    words = argv if argv is not None else sys.argv[1:]
    given = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    if args.out is None:
        parser.error("--paper needs --out FOLDER")
    if given & {
        "--cost",
        "--compare",
        "--scale",
        "--latency-cap",
        "--repeats",
        "--pack-latency",
        "--no-pack-latency",
        "--isolated",
    }:
        parser.error("--paper sets each figure's cost and latency cap; --cost, --compare, --scale, "
                     "--latency-cap, --[no-]pack-latency, --isolated and --repeats do not apply")  # fmt: skip
    figures = list(PAPER_FIGURES) if "all" in args.figures or "--figures" not in given else args.figures
    missing = [f for f in figures if f not in PAPER_FIGURES]
    if missing:
        parser.error(
            f"no paper-size workloads for {', '.join(missing)}; there are {', '.join(PAPER_FIGURES)}"
        )
    systems = args.systems if "--systems" in given else list(PAPER_SYSTEMS)
    run_paper(figures, systems, args.out, _tokenizer(args.tokenizer), seed=args.seed)
    print(args.out / "paper.md")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _counted(app) -> bool:
    """An app the suite's latency figures count (no error, not a background chat)."""
    error = app["error"] if isinstance(app, dict) else app.error
    kind = app["kind"] if isinstance(app, dict) else app.kind
    return error is None and kind != "chat"


def _app_mean(latencies) -> float:
    values = list(latencies)
    return statistics.fmean(values) if values else float("nan")


def _real_means(raw: Path) -> dict[tuple[str, str], float]:
    """(workload, system) -> the mean over repeats of the mean counted app latency."""
    per_repeat: dict[tuple[str, str], list[float]] = {}
    for run in json.loads(raw.read_text()):
        apps = [a["end_s"] - a["arrival_s"] for a in run["apps"] if _counted(a)]
        if apps:
            per_repeat.setdefault((run["workload"], run["system"]), []).append(statistics.fmean(apps))
    return {key: statistics.fmean(v) for key, v in per_repeat.items()}


def print_comparison(real: dict[tuple[str, str], float], simulated: dict[tuple[str, str], float]) -> None:
    """Real against simulated per workload and system, then per figure the errors."""
    print(f"\n{'workload':40s} {'system':26s} {'real (s)':>9s} {'sim (s)':>9s} {'error':>7s}")
    errors: dict[tuple[str, str], list[float]] = {}
    for (workload, system), sim in simulated.items():
        if (workload, system) not in real:
            continue
        measured = real[(workload, system)]
        error = (sim - measured) / measured
        errors.setdefault((workload.split("/")[0], system), []).append(error)
        print(f"{workload:40s} {system:26s} {measured:9.2f} {sim:9.2f} {error:+7.0%}")
    print(f"\n{'figure':10s} {'system':26s} {'mean |error|':>12s} {'max |error|':>12s}")
    for (figure, system), errs in errors.items():
        mean = statistics.fmean(abs(e) for e in errs)
        print(f"{figure:10s} {system:26s} {mean:12.0%} {max(abs(e) for e in errs):12.0%}")


if __name__ == "__main__":
    sys.exit(main())
