"""Prefill speed of the built-in engine against its step size and prompt attention kernel.

    python benchmarks/prefill_speed.py [--model smollm2] [--dtype bfloat16] [--prompts 32]
        [--prompt-tokens 100] [--max-step-tokens 512 2048] [--bf16-prefill on off]
        [--repeats 5] [--threads 2]

In-process: one :class:`~parrot.engine.local.LocalEngine` per ``--max-step-tokens``
value and ``--bf16-prefill`` setting (prompt attention on Parrot's C kernel, AMX tiles or
AVX-512 BF16 as the CPU has, or PyTorch's flash attention; the other kernel options from
the ``PARROT_*`` variables), over one loaded model.  In each repeat every engine, in turn (the order
alternating between repeats), fills ``--prompts`` random prompts of about
``--prompt-tokens`` tokens (up to a quarter longer, so lengths differ) at once, new
prompts each time so that the prefix cache never hits; the figure is prompt tokens
per second of wall time until the last fill is done.  Only one engine works at a
time (the others idle on their queues).  A warm-up first touches each engine's KV
pages (first writes to fresh memory cost more than the computation on this VM).
Prints each engine's median and the median of the per-repeat ratios to the first
engine, with their range.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import replace

import torch

from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine


async def fill_all(engine: LocalEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens per second of filling every prompt at once (contexts freed after)."""
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.fill(p, 1000 + i) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    for i in range(len(prompts)):
        await engine.free_context(1000 + i)
    return sum(map(len, prompts)) / wall


def prompts_for(rng: random.Random, count: int, tokens: int, vocab: int) -> list[list[int]]:
    return [
        [rng.randrange(100, vocab) for _ in range(tokens + rng.randrange(tokens // 4 + 1))]
        for _ in range(count)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-step-tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--bf16-prefill", choices=["on", "off"], nargs="+", default=["on"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model)
    vocab = loaded.tokenizer.vocab_size
    rng = random.Random(0)
    steps = [(step, kernel) for step in args.max_step_tokens for kernel in args.bf16_prefill]
    env = KernelOptions.from_env()
    engines = {
        (step, kernel): LocalEngine(
            loaded, max_step_tokens=step, weight_dtype=dtype, kv_dtype=dtype, latency_probe=False,
            kernels=replace(env, bf16_prefill=kernel == "on"),
        )
        for step, kernel in steps
    }  # fmt: skip
    print(
        f"# {args.prompts} prompts of ~{args.prompt_tokens} tokens, {args.model} {args.dtype}, "
        f"{args.threads} threads, {args.repeats} repeats"
    )
    for (step, kernel), engine in engines.items():
        print(f"#   max_step_tokens {step}, bf16-prefill {kernel}: {engine.runner.kernels.describe()}")
    try:
        for engine in engines.values():  # warm-up: the pool's pages, oneDNN's kernels
            for _ in range(3):
                asyncio.run(fill_all(engine, prompts_for(rng, args.prompts * 4, args.prompt_tokens, vocab)))
        tps: dict[tuple[int, str], list[float]] = {step: [] for step in steps}
        for r in range(args.repeats):
            for step in steps if r % 2 == 0 else steps[::-1]:
                prompts = prompts_for(rng, args.prompts, args.prompt_tokens, vocab)
                tps[step].append(asyncio.run(fill_all(engines[step], prompts)))
    finally:
        for engine in engines.values():
            engine.close()
    first = steps[0]
    for step in steps:
        ratios = [a / b for a, b in zip(tps[step], tps[first], strict=True)]
        print(
            f"max_step_tokens {step[0]:5d} bf16-prefill {step[1]:3s}: {statistics.median(tps[step]):7.0f} "
            f"tok/s [{min(tps[step]):.0f}, {max(tps[step]):.0f}], x first: {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}, {max(ratios):.2f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
