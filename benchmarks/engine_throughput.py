"""Decode throughput of the built-in engine at several concurrencies.

    python benchmarks/engine_throughput.py [--model smollm2] [--concurrency 1 16 32]
        [--prompt-tokens 100] [--max-tokens 64] [--shared-prefix 0] [--no-share] [--repeat 1]
        [--weight-dtype bfloat16] [--kv-dtype bfloat16] [--threads 2] [--device cuda [--dtype bfloat16]]

Each of ``c`` concurrent requests fills its own random ``prompt-tokens`` prompt
(forked from one common ``shared-prefix``-token context if that is > 0) and
generates ``max-tokens`` tokens greedily (EOS ignored).  ``--no-share`` turns
off shared-prefix decode attention (the engine's A/B baseline).  Reports generated
tokens per second over the wall time of the whole batch (prefill included)
and over the decode phase alone (first token of the last request to finish
the last one).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import time

import torch

from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine
from parrot.protocol.sampling import SamplingParams


async def one(
    engine: LocalEngine, ctx: int, prompt: list[int], sp: SamplingParams, parent: int | None
) -> tuple[float, int]:
    await engine.fill(prompt, ctx, parent)
    first = None
    n = 0
    async for chunk in engine.generate(sp, ctx):
        if first is None:
            first = time.perf_counter()
        n += len(chunk.token_ids)
    await engine.free_context(ctx)
    assert first is not None
    return first, n


async def run(
    engine: LocalEngine, c: int, prompt_tokens: int, max_tokens: int, seed: int, shared: int = 0
) -> tuple[float, float]:
    vocab = engine.tokenizer.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(c)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    parent = None
    if shared:
        parent = 10_000 * seed + 9_999
        await engine.fill([rng.randrange(100, vocab) for _ in range(shared)], parent)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(one(engine, 10_000 * seed + i, p, sp, parent) for i, p in enumerate(prompts))
    )
    t1 = time.perf_counter()
    if parent is not None:
        await engine.free_context(parent)
    total = sum(n for _, n in results)
    last_first = max(f for f, _ in results)
    return total / (t1 - t0), total / max(t1 - last_first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--no-share", action="store_true")
    ap.add_argument("--weight-dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="on CUDA")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs: dict[str, object] = {}
    kwargs["device"] = args.device
    for name in ("weight_dtype", "kv_dtype", "dtype"):
        if getattr(args, name):
            kwargs[name] = getattr(torch, getattr(args, name))
    if args.no_share and "share_prefix" in inspect.signature(LocalEngine).parameters:
        kwargs["share_prefix"] = False
    engine = LocalEngine(
        lambda: load_model(args.model), **kwargs, kernels=KernelOptions.from_env()
    )  # loaded on the engine's thread
    try:
        asyncio.run(run(engine, 2, 16, 4, seed=999))  # warm-up
        for c in args.concurrency:
            for r in range(args.repeat):
                total, decode = asyncio.run(
                    run(engine, c, args.prompt_tokens, args.max_tokens, r + 1, args.shared_prefix)
                )
                print(
                    f"concurrency {c:3d}: {total:8.1f} tok/s overall, {decode:8.1f} tok/s decode", flush=True
                )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
