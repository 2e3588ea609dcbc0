"""Where the built-in engine's time goes: a profile of its worker thread, and prefill speed.

    python benchmarks/engine_profile.py [--model smollm2] [--concurrency 16] [--prompt-tokens 100]
        [--max-tokens 32] [--threads 2] [--top 12] [--weight-dtype bfloat16] [--kv-dtype bfloat16]

1. ``--concurrency`` requests of ``--prompt-tokens`` random tokens each generate
   ``--max-tokens`` tokens (greedy, EOS ignored) while cProfile records the engine's
   worker thread (the forward steps, not the asyncio side); prints tokens/s (overall
   and decode phase) and the ``--top`` functions by own time.
2. Prefill alone: one 2,000-token prompt, then 32 prompts of 100 tokens, as tokens/s.

The figures in docs/engine.md ("where Parrot's time goes") come from this script.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import run

from parrot.engine import runner as runner_mod
from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine


def profile_steps(engine: LocalEngine, args: argparse.Namespace) -> pstats.Stats:
    """Run the generation workload with cProfile enabled around every engine step."""
    profiler = cProfile.Profile()
    step = runner_mod.EngineRunner._step

    def profiled(self: runner_mod.EngineRunner) -> None:
        profiler.enable()
        try:
            step(self)
        finally:
            profiler.disable()

    runner_mod.EngineRunner._step = profiled  # type: ignore[method-assign]
    try:
        overall, decode = asyncio.run(run(engine, args.concurrency, args.prompt_tokens, args.max_tokens, 2))
    finally:
        runner_mod.EngineRunner._step = step  # type: ignore[method-assign]
    print(f"c={args.concurrency}: {overall:.1f} tok/s overall, {decode:.1f} tok/s decode phase")
    return pstats.Stats(profiler)


async def prefill(engine: LocalEngine) -> None:
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    for n, count in ((2000, 1), (100, 32)):
        prompts = [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(count)]
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.fill(p, 100 + i) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        print(f"prefill {count} x {n} tokens: {count * n / wall:.0f} tok/s ({wall:.2f} s)")
        for i in range(count):
            await engine.free_context(100 + i)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--weight-dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = {n: getattr(torch, getattr(args, n)) for n in ("weight_dtype", "kv_dtype") if getattr(args, n)}
    engine = LocalEngine(lambda: load_model(args.model), **dtypes, kernels=KernelOptions.from_env())
    try:
        asyncio.run(run(engine, 2, 16, 4, seed=999))  # warm-up
        stats = profile_steps(engine, args)
        stats.sort_stats("tottime").print_stats(args.top)
        asyncio.run(prefill(engine))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
