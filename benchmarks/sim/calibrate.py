"""``python -m benchmarks.sim.calibrate``: fit the simulator's step cost to the real engine.

    python -m benchmarks.sim.calibrate [--model smollm2] [--dtype bfloat16] [--threads N]
        [--repeats 5] [--stat median|min] [--quick] [--out FILE]
    python -m benchmarks.sim.calibrate --from-step-log FILE [FILE ...] [--model smollm2]
        [--dtype bfloat16] [--out FILE]

Times single steps of the real engine (:class:`~parrot.engine.runner.EngineRunner`,
configured as the evaluation suite starts one: the model in ``--dtype`` weights and
KV cache, packed weights, all of the machine's threads) over a grid of batches:
prompt chunks of up to 2k tokens at several start positions, 1-64 decoding sequences
of 16-4k KV tokens each, decoding sequences forked from one shared prefix with the
shared-prefix attention on and off, and prompt chunks mixed with decodes.  Nothing is
prefilled to build a point: like the engine's latency probe
(:mod:`parrot.engine.latency_probe`) it fabricates contexts whose KV blocks are
allocated, zeroed and marked computed, queues them, and times one
``EngineRunner._forward`` (planning, the forward pass and the logits of finished
sequences; not sampling).  Each point's work is measured by
:func:`parrot.sim.cost.step_work` on the step the engine planned, exactly as the
simulated engine measures its own steps.

It then fits :class:`~parrot.sim.cost.StepCost` by least squares
(:func:`parrot.sim.fit.fit_step_cost`) twice: the first-order form (no prefill
attention term) and the full one, prints both fits and each point's relative error,
and writes the full fit as a cost file that ``python -m benchmarks.sim --cost FILE``
loads, recording the machine, the commit and every point.  Timings are only as good
as the machine is quiet: run it with nothing else on the cores.

``--from-step-log`` fits the same model to the steps of served runs instead: the
lines an engine started with ``--step-log FILE`` wrote
(:mod:`parrot.engine.step_log`; the evaluation suite's ``--step-log`` gives every
Parrot engine one).  Those steps carry what isolated ones do not: sampling,
admission and planning, and the rest of the server sharing the cores.  It prints
two full fits, one of the relative errors and one of the errors in seconds, with
the relative error per kind of step (decode only, prompt only, mixed) and the ratio
of the model's total time to the measured total, and writes the fit in seconds
(the one whose total time matches a served run's) with the logs' names and step
counts.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.suite.systems import cpu_cores

from parrot.sim.cost import CostProfile, StepWork, step_work
from parrot.sim.fit import TERMS, Fit, fit_step_cost

if TYPE_CHECKING:
    from parrot.engine.runner import EngineRunner

ROOT = Path(__file__).resolve().parents[2]
FIRST_ORDER = ("base", "per_prefill_token", "per_decode_seq", "per_kv_token")


@dataclass(frozen=True)
class Point:
    """One step's batch: a prompt chunk of ``prefill`` tokens after ``prefill_start``
    computed ones, and ``decodes`` sequences of ``kv_per_seq`` computed tokens each (after
    a ``shared`` prefix they all fork from), with the shared-prefix kernel on or off."""

    prefill: int = 0
    prefill_start: int = 0
    decodes: int = 0
    kv_per_seq: int = 0
    shared: int = 0
    share_kernel: bool = True

    def label(self) -> str:
        parts = []
        if self.prefill:
            parts.append(f"prefill {self.prefill}@{self.prefill_start}")
        if self.decodes:
            shared = f" after {self.shared} shared ({'once' if self.share_kernel else 'per seq'})"
            parts.append(f"{self.decodes} x decode {self.kv_per_seq}" + (shared if self.shared else ""))
        return ", ".join(parts)

    def kv_tokens(self) -> int:
        return self.prefill_start + self.prefill + self.shared + self.decodes * (self.kv_per_seq + 1)


def grid(quick: bool, max_kv: int, max_seq: int) -> list[Point]:
    """The calibration's batches (``quick``: a handful, for the tiny model and tests);
    points holding more than ``max_kv`` KV tokens or a context over ``max_seq`` are left out."""
    if quick:
        prefill, starts, decodes, kvs = (16, 64), (0, 64), (1, 4), (16, 128)
        shared, owns, mixed = [(4, 64)], (16,), [(32, 4, 64)]
    else:
        prefill, starts, decodes, kvs = (
            (32, 128, 512, 1024, 2048),
            (0, 1024, 2048),
            (1, 4, 16, 64),
            (16, 256, 1024, 4096),
        )
        shared = [(d, s) for d in (4, 16, 64) for s in (512, 2048, 4096)]
        owns, mixed = (16, 256), [(p, d, 1024) for p in (128, 512) for d in (4, 16)]
    points = [Point(prefill=p, prefill_start=s) for p in prefill for s in starts]
    points += [Point(decodes=d, kv_per_seq=kv) for d in decodes for kv in kvs]
    points += [
        Point(decodes=d, kv_per_seq=own, shared=s, share_kernel=k)
        for d, s in shared
        for own in owns
        for k in (True, False)
    ]
    points += [Point(prefill=p, decodes=d, kv_per_seq=kv) for p, d, kv in mixed]
    longest = lambda p: max(p.prefill_start + p.prefill, p.shared + p.kv_per_seq + 1)  # noqa: E731
    return [p for p in points if p.kv_tokens() <= max_kv and longest(p) <= max_seq]


def _fabricate(
    runner: EngineRunner, cid: int, parent: int | None, computed: int, pending: int, queue: bool
) -> None:
    """A context of ``computed`` zeroed, computed KV tokens (after its parent's) and
    ``pending`` more to compute; ``queue``: a running job computes them in the next step."""
    import torch

    from parrot.engine.core.jobs import Job

    contexts, vocab = runner.contexts, runner.loaded.config.vocab_size
    ctx = contexts.open(cid, parent)
    contexts.append(ctx, [(7 * cid + 3 * i) % vocab for i in range(computed + pending)])
    if computed:
        if contexts.reserve(ctx, computed) is None:
            raise RuntimeError("the calibration's KV pool is too small for its grid")
        ctx.computed_len += computed
        blocks = torch.tensor(ctx.block_table, dtype=torch.long, device=runner.cache.device)
        runner.cache.k.index_fill_(1, blocks, 0.0)
        runner.cache.v.index_fill_(1, blocks, 0.0)
    if queue:
        ctx.busy = True
        runner.planner.running.append(Job(cid, None, internal=True, ctx=ctx))


def time_point(runner: EngineRunner, point: Point) -> tuple[StepWork, float]:
    """Build the point's contexts, time one step over them, free them."""
    made: list[int] = []
    planned: list[StepWork] = []
    reserve = runner.planner.reserve

    def capture(plan: list) -> list:
        plan = reserve(plan)
        planned.append(step_work((s for _, s in plan), runner.pool.block_size, runner.share_prefix))
        return plan

    runner.share_prefix = point.share_kernel
    try:
        # each id is noted before its context is made, so a failure part-way frees it too
        if point.prefill:
            made.append(1)
            _fabricate(runner, 1, None, point.prefill_start, point.prefill, queue=True)
        if point.shared:
            made.append(2)
            _fabricate(runner, 2, None, point.shared, 0, queue=False)
        for i in range(point.decodes):
            made.append(100 + i)
            _fabricate(runner, 100 + i, 2 if point.shared else None, point.kv_per_seq, 1, queue=True)
        runner.planner.reserve = capture
        started = time.perf_counter()
        runner._forward()
        seconds = time.perf_counter() - started
        if runner.planner.running or len(planned) != 1:
            raise RuntimeError(f"{point.label()}: the engine did not compute the point in one step")
        return planned[0], seconds
    finally:
        runner.planner.reserve = reserve
        runner.planner.take_all()
        for cid in reversed(made):
            if cid in runner.contexts:
                runner.contexts.free(cid)


def machine() -> dict[str, object]:
    """What the timings were taken on (CPU model, cores, OS, library versions)."""
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def commit() -> dict[str, object]:
    """The checkout's commit and whether it had uncommitted changes (None: not a git checkout)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def make_runner(model: str, dtype: str, points: list[Point]) -> EngineRunner:
    """An engine as the suite starts one (packed weights, ``dtype`` weights and KV), its step
    and KV pool sized for ``points``; no prefix cache, so fabricated tokens never hit it."""
    import torch

    from parrot.engine.config import EngineConfig
    from parrot.engine.core.block_pool import DEFAULT_BLOCK_SIZE
    from parrot.engine.loader import load_model
    from parrot.engine.runner import EngineRunner

    torch.set_grad_enabled(False)
    weights = torch.bfloat16 if dtype == "bfloat16" else None
    step = max(p.prefill + p.decodes for p in points)
    # every context of a point may leave its last block part-filled: one block each to spare
    kv = max(p.kv_tokens() + DEFAULT_BLOCK_SIZE * (p.decodes + 2) for p in points)
    config = EngineConfig(
        max_step_tokens=step, prefix_cache=False, kv_cache_tokens=kv, weight_dtype=weights, kv_dtype=weights
    )
    return EngineRunner(load_model(model), config)


def measure(
    runner: EngineRunner, points: list[Point], repeats: int, stat: str
) -> list[tuple[Point, StepWork, float]]:
    """Each point's work and its ``stat`` step time over ``repeats`` steps (after one warm-up
    pass over the whole grid), the points taken in turn so that a slower spell of the
    machine spreads over all of them."""
    for p in points:
        time_point(runner, p)
    times: dict[Point, list[float]] = {p: [] for p in points}
    works: dict[Point, StepWork] = {}
    for _ in range(repeats):
        for p in points:
            works[p], seconds = time_point(runner, p)
            times[p].append(seconds)
    pick = min if stat == "min" else statistics.median
    return [(p, works[p], pick(times[p])) for p in points]


def report(rows: list[tuple[Point, StepWork, float]], fits: dict[str, Fit]) -> None:
    names = list(fits)
    print(f"{'point':58s} {'measured':>9s} " + " ".join(f"{n:>14s}" for n in names))
    for i, (p, _, seconds) in enumerate(rows):
        errs = " ".join(f"{fits[n].rel_errors[i]:+13.1%} " for n in names)
        print(f"{p.label():58s} {seconds * 1e3:7.2f}ms {errs}")
    for name, fit in fits.items():
        params = ", ".join(f"{t}={getattr(fit.cost, t):.4g}" for t in TERMS)
        print(f"{name}: {params}; rms error {fit.rms_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")


def _kind(work: StepWork) -> str:
    if not work.prefill_tokens:
        return "decode only"
    return "prompt only" if not work.decode_seqs else "mixed"


def report_log(samples: list[tuple[StepWork, float]], fits: dict[str, Fit]) -> None:
    """The served steps' fit, by kind of step: count, measured total, and each fit's rms
    relative error and ratio of modelled to measured total seconds."""
    kinds = sorted({_kind(w) for w, _ in samples})
    print(
        f"{'steps':14s} {'count':>7s} {'seconds':>9s} " + " ".join(f"{n + ' rms / total':>26s}" for n in fits)
    )
    for kind in [*kinds, "all"]:
        idx = [i for i, (w, _) in enumerate(samples) if kind == "all" or _kind(w) == kind]
        measured = sum(samples[i][1] for i in idx)
        cells = []
        for fit in fits.values():
            errs = [fit.rel_errors[i] for i in idx]
            rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
            modelled = sum(fit.cost.step_seconds(samples[i][0]) for i in idx)
            cells.append(f"{rms:>15.1%} / {modelled / measured:>6.3f}x")
        print(f"{kind:14s} {len(idx):7d} {measured:9.2f} " + " ".join(f"{c:>26s}" for c in cells))
    for name, fit in fits.items():
        params = ", ".join(f"{t}={getattr(fit.cost, t):.4g}" for t in TERMS)
        print(f"{name}: {params}; rms error {fit.rms_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")


def from_step_logs(args: argparse.Namespace) -> int:
    from parrot.engine.step_log import read_step_log

    per_log = {str(path): [row for row in read_step_log(path) if row[1] > 0] for path in args.from_step_log}
    samples = [row for rows in per_log.values() for row in rows]
    if not samples:
        raise SystemExit("the step logs hold no steps")
    fits = {
        "relative": fit_step_cost(samples, TERMS),
        "seconds": fit_step_cost(samples, TERMS, relative=False),
    }
    report_log(samples, fits)
    name = f"{Path(args.model).name}-{args.dtype}-served"
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "source": "step logs of served runs",
        "logs": {path: len(rows) for path, rows in per_log.items()},
        "machine": machine(),
        **commit(),
        "fit": "least squares in seconds (the served steps' total time)",
        "rms_rel_error": fits["seconds"].rms_rel_error,
        "max_abs_rel_error": fits["seconds"].max_abs_rel_error,
        "relative_fit_rms_rel_error": fits["relative"].rms_rel_error,
    }
    out = args.out or Path(f"step-cost-{Path(args.model).name}-{args.dtype}-served.json")
    out.write_text(CostProfile(name, fits["seconds"].cost, None, meta).to_json())
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.sim.calibrate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="smollm2", help="a load_model name ('smollm2', 'tiny') or path")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=cpu_cores(), help="default: this process's cores")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument("--max-kv", type=int, default=1 << 17, help="leave out points holding more KV tokens")
    ap.add_argument("--quick", action="store_true", help="a small grid (tests, the tiny model)")
    ap.add_argument("--out", type=Path, default=None, help="default: step-cost-MODEL-DTYPE.json")
    ap.add_argument(
        "--from-step-log",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="fit to the steps of served runs (engines' --step-log files) instead of timing a grid",
    )
    args = ap.parse_args(argv)
    if args.from_step_log:
        return from_step_logs(args)
    if args.repeats < 1 or args.threads < 1 or args.max_kv < 1:
        ap.error("--repeats, --threads and --max-kv must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    from parrot.engine.loader import load_model

    max_seq = load_model(args.model).config.max_seq_len
    points = grid(args.quick, args.max_kv, max_seq)
    runner = make_runner(args.model, args.dtype, points)
    rows = measure(runner, points, args.repeats, args.stat)
    samples = [(w, s) for _, w, s in rows]
    fits = {"first-order": fit_step_cost(samples, FIRST_ORDER), "full": fit_step_cost(samples, TERMS)}
    report(rows, fits)
    name = f"{Path(args.model).name}-{args.dtype}-calibrated"
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "stat": args.stat,
        "machine": machine(),
        **commit(),
        "rms_rel_error": fits["full"].rms_rel_error,
        "max_abs_rel_error": fits["full"].max_abs_rel_error,
        "first_order_rms_rel_error": fits["first-order"].rms_rel_error,
        "points": [
            {"point": asdict(p), "work": asdict(w), "seconds": s, "rel_error": e}
            for (p, w, s), e in zip(rows, fits["full"].rel_errors, strict=True)
        ],
    }
    out = args.out or Path(f"step-cost-{Path(args.model).name}-{args.dtype}.json")
    out.write_text(CostProfile(name, fits["full"].cost, None, meta).to_json())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
