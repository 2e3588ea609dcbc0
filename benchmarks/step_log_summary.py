"""What an engine's step log says about its costs, and the mean latency of chains batched k at a time.

    python benchmarks/step_log_summary.py STEPS.jsonl [--chains 25] [--calls 4] [--prompt 250]
        [--output 25] [--batches 7 9 12 25]

Reads a step log (``parrot serve --step-log``, :mod:`parrot.engine.step_log`) and prints:

* decode-only steps (no prompt tokens) by batch, four sequences to a bucket: count and
  median milliseconds;
* the fitted costs: ``a`` (a decode step's fixed cost) and ``c`` (per sequence) from a
  least-squares line through the per-batch medians of decode-only steps, and ``p`` (per
  prompt token): the time of steps with prompt tokens beyond their decodes' ``a + c * b``,
  over their prompt tokens;
* the share of the step time spent in steps that compute prompt tokens;
* for each ``--batches`` value k: the mean latency of ``--chains`` chains of ``--calls``
  calls (``--prompt`` prompt tokens and ``--output`` generated tokens each) served k
  chains at a time, one batch after another: a call step takes ``k * P * p + O * (a + c * k)``
  and the mean chain finishes after ``(N / k + 1) / 2`` batches;
* for each ``--prefill-speedups`` value s (default 1, 2, 4): with ``p`` divided by s, the
  batch k that gives the lowest mean latency, that mean, the mean of all chains at once
  (k = N, what a request-level server that admits every request does), and their ratio:
  by this model, the most that batching chains by application can gain on this engine
  over serving them all at once.  Faster prompt computation makes decode steps a larger
  share of the time, so batching them matters more and the ratio falls.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from parrot.engine.core.step_work import StepWork
from parrot.engine.step_log import read_step_log

BUCKET = 4  # decode sequences per reported bucket


@dataclass(frozen=True)
class StepCosts:
    a: float  # seconds: a decode step's fixed cost
    c: float  # seconds per decode sequence
    p: float  # seconds per prompt token
    prompt_share: float  # of the step time, in steps with prompt tokens


def decode_medians(rows: list[tuple[StepWork, float]]) -> dict[int, tuple[int, float]]:
    """Decode-only steps by batch bucket (its first batch size): (count, median seconds)."""
    buckets: dict[int, list[float]] = defaultdict(list)
    for work, seconds in rows:
        if work.prefill_tokens == 0 and work.decode_seqs > 0:
            buckets[work.decode_seqs // BUCKET * BUCKET].append(seconds)
    return {b: (len(v), statistics.median(v)) for b, v in sorted(buckets.items())}


def fit_costs(rows: list[tuple[StepWork, float]]) -> StepCosts:
    """The costs described in the module docstring; ValueError when the log has decode-only
    steps at fewer than two batch sizes or no step with prompt tokens."""
    by_batch: dict[int, list[float]] = defaultdict(list)
    for work, seconds in rows:
        if work.prefill_tokens == 0 and work.decode_seqs > 0:
            by_batch[work.decode_seqs].append(seconds)
    if len(by_batch) < 2:
        raise ValueError("the log needs decode-only steps at two batch sizes at least")
    batches = sorted(by_batch)
    c, a = statistics.linear_regression(batches, [statistics.median(by_batch[b]) for b in batches])
    prompted = [(w, s) for w, s in rows if w.prefill_tokens > 0]
    if not prompted:
        raise ValueError("the log has no step with prompt tokens")
    beyond = sum(s - (a + c * w.decode_seqs) for w, s in prompted)
    p = beyond / sum(w.prefill_tokens for w, _ in prompted)
    share = sum(s for _, s in prompted) / sum(s for _, s in rows)
    return StepCosts(a, c, p, share)


def chain_mean_latency(costs: StepCosts, k: int, chains: int, calls: int, prompt: int, output: int) -> float:
    """Mean latency (s) of ``chains`` chains served ``k`` at a time (see the module docstring)."""
    step = k * prompt * costs.p + output * (costs.a + costs.c * k)
    return calls * step * (chains / k + 1) / 2


def best_batch(costs: StepCosts, chains: int, calls: int, prompt: int, output: int) -> tuple[int, float]:
    """The batch k in 1..chains with the lowest :func:`chain_mean_latency`, and that latency."""
    means = {k: chain_mean_latency(costs, k, chains, calls, prompt, output) for k in range(1, chains + 1)}
    k = min(means, key=means.__getitem__)
    return k, means[k]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--chains", type=int, default=25)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=250)
    ap.add_argument("--output", type=int, default=25)
    ap.add_argument("--batches", type=int, nargs="+", default=[7, 9, 12, 25])
    ap.add_argument("--prefill-speedups", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    args = ap.parse_args(argv)
    rows = read_step_log(args.log)
    print(f"# {args.log}: {len(rows)} steps, {sum(s for _, s in rows):.1f} s")
    for b, (n, median) in decode_medians(rows).items():
        print(f"decode-only, {max(b, 1)}-{b + BUCKET - 1} sequences: {n} steps, median {median * 1e3:.1f} ms")
    costs = fit_costs(rows)
    print(
        f"a = {costs.a * 1e3:.1f} ms, c = {costs.c * 1e3:.2f} ms per sequence, "
        f"p = {costs.p * 1e3:.3f} ms per prompt token; steps with prompt tokens: "
        f"{100 * costs.prompt_share:.0f}% of the step time"
    )
    for k in args.batches:
        mean = chain_mean_latency(costs, k, args.chains, args.calls, args.prompt, args.output)
        print(f"{args.chains} chains, {k} at a time: mean latency {mean:.1f} s")
    shape = (args.chains, args.calls, args.prompt, args.output)
    for speedup in args.prefill_speedups:
        faster = dataclasses.replace(costs, p=costs.p / speedup)
        k, best = best_batch(faster, *shape)
        together = chain_mean_latency(faster, args.chains, *shape)
        print(
            f"prompt tokens {speedup:g}x as fast: best {k} at a time, mean {best:.1f} s; all "
            f"{args.chains} at once {together:.1f} s; ratio {together / best:.2f}x"
        )


if __name__ == "__main__":
    main()
