"""Prefill speed of the built-in engine: many new prompts at once, with and without batching them.

    python benchmarks/prefill_speed.py [--model smollm2] [--dtype bfloat16] [--prompts 32]
        [--prompt-tokens 100] [--max-step-tokens 512 2048] [--repeats 5] [--threads 2]

In-process (one :class:`~parrot.engine.local.LocalEngine` per ``--max-step-tokens``
value), ``--prompts`` random prompts of about ``--prompt-tokens`` tokens each (up to
a quarter longer, so lengths differ) are filled at once; the figure is prompt tokens
per second of wall time until the last fill is done.  Two modes run interleaved within
each repeat, in alternating order, on fresh prompts each time (the prefix cache never
hits):

* ``batched``: the engine as it is (the chunks that begin a sequence attend in padded
  batches, :mod:`parrot.engine.fresh_prefill`);
* ``per-chunk``: that batching switched off (one attention call per chunk).

A warm-up round first touches the KV pool's pages (first writes to fresh memory cost
more than the computation on this VM).  Prints the median tokens/s of each mode and
the median of the per-repeat ratios with their range.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Iterator

import torch

from parrot.engine import paged
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine

MODES = ("batched", "per-chunk")


async def fill_all(engine: LocalEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of filling every prompt at once (contexts freed after)."""
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.fill(p, 1000 + i) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    for i in range(len(prompts)):
        await engine.free_context(1000 + i)
    return sum(map(len, prompts)) / wall


def prompts_for(seed: int, count: int, tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab) for _ in range(tokens + rng.randrange(tokens // 4 + 1))]
        for _ in range(count)
    ]


def run(engine: LocalEngine, args: argparse.Namespace, seeds: Iterator[int]) -> dict[str, list[float]]:
    real = paged.fresh_batching_available
    vocab = engine.tokenizer.vocab_size
    for _ in range(3):  # warm-up: the pool's pages, oneDNN's kernels
        asyncio.run(fill_all(engine, prompts_for(next(seeds), args.prompts * 4, args.prompt_tokens, vocab)))
    out: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                paged.fresh_batching_available = real if mode == "batched" else (lambda q: False)
                prompts = prompts_for(next(seeds), args.prompts, args.prompt_tokens, vocab)
                out[mode].append(asyncio.run(fill_all(engine, prompts)))
    finally:
        paged.fresh_batching_available = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-step-tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model)
    seeds = iter(range(10**6))
    print(
        f"# {args.prompts} prompts of ~{args.prompt_tokens} tokens, {args.model} {args.dtype}, "
        f"{args.threads} threads, {args.repeats} repeats"
    )
    for step in args.max_step_tokens:
        engine = LocalEngine(
            loaded,
            max_step_tokens=step,
            weight_dtype=dtype,
            kv_dtype=dtype,
            latency_probe=False,
            kernels=KernelOptions.from_env(),
        )
        try:
            tps = run(engine, args, seeds)
        finally:
            engine.close()
        ratios = [b / p for b, p in zip(tps["batched"], tps["per-chunk"], strict=True)]
        print(
            f"max_step_tokens {step:5d}: batched {statistics.median(tps['batched']):7.0f} tok/s, "
            f"per-chunk {statistics.median(tps['per-chunk']):7.0f} tok/s, batched/per-chunk "
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
