"""Peak KV-pool memory: N contexts forked from one long prefix vs N private copies.

    python benchmarks/kv_memory.py [--contexts 64] [--prefix-tokens 6000] [--suffix-tokens 100]
        [--max-tokens 16]

Runs the built-in engine twice on a seeded tiny random LLaMA whose context is
stretched to fit (block accounting does not depend on the model's width):

* ``forked``: fill the prefix once, fork ``--contexts`` children from it, fill
  each child's own suffix and generate ``--max-tokens`` tokens in all of them at
  once;
* ``private``: every context fills prefix + suffix itself (what a server without
  forking stores), then the same generation.

The engine's block pool is sampled after every step (``kv_blocks_used``); the
peak is reported in blocks, and in bytes for SmolLM2-135M (fp32) and for the
LLaMA-7B layout (32 layers x 32 kv heads x 128, fp16), the layout the paper uses.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.engine.model import LlamaModel, ModelConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import TextTokenizer

# KV bytes per token: 2 (K and V) x layers x kv heads x head dim x bytes per element.
LAYOUTS = {
    "SmolLM2-135M fp32": 2 * 30 * 3 * 64 * 4,
    "LLaMA-7B fp16": 2 * 32 * 32 * 128 * 2,
}


def stretched_tiny(max_seq_len: int) -> LoadedModel:
    config = ModelConfig.tiny().replace(max_seq_len=max_seq_len)
    return LoadedModel("tiny", config, LlamaModel.random_init(config, 0), TextTokenizer.byte_level_tiny())


async def run(engine: LocalEngine, forked: bool, args: argparse.Namespace) -> int:
    """Fill and generate; return the peak number of KV blocks in use."""
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab - 3) for _ in range(n)]

    prefix = tokens(args.prefix_tokens)
    suffixes = [tokens(args.suffix_tokens) for _ in range(args.contexts)]
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine.runner.stats().kv_blocks_used)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    parent = None
    if forked:
        parent = 1_000_000
        await engine.fill(prefix, parent)
        for i, suffix in enumerate(suffixes):
            await engine.fill(suffix, i, parent)
    else:
        for i, suffix in enumerate(suffixes):
            await engine.fill(prefix + suffix, i)

    async def gen(ctx: int) -> None:
        async for _ in engine.generate(sp, ctx):
            pass

    await asyncio.gather(*(gen(i) for i in range(args.contexts)))
    peak = max(peak, engine.runner.stats().kv_blocks_used)
    sampler.cancel()
    for i in range(args.contexts):
        await engine.free_context(i)
    if parent is not None:
        await engine.free_context(parent)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=6000)
    ap.add_argument("--suffix-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    per_ctx = args.prefix_tokens + args.suffix_tokens + args.max_tokens
    loaded = stretched_tiny(per_ctx + 16)
    rows = []
    for forked in (True, False):
        engine = LocalEngine(
            loaded,
            kv_cache_tokens=args.contexts * (per_ctx + 64) + args.prefix_tokens,
            kernels=KernelOptions.from_env(),
        )
        try:
            block_size = engine.runner.pool.block_size
            peak = asyncio.run(run(engine, forked, args))
        finally:
            engine.close()
        rows.append(("forked from one prefix" if forked else "private copies", peak))
    print(
        f"{args.contexts} contexts, {args.prefix_tokens}-token prefix, {args.suffix_tokens}-token suffixes, "
        f"{args.max_tokens} generated tokens each; block size {block_size}"
    )
    header = "| KV pool at peak | blocks | " + " | ".join(LAYOUTS) + " |"
    print(header)
    print("|---|---:|" + "---:|" * len(LAYOUTS))
    for label, peak in rows:
        sizes = " | ".join(f"{peak * block_size * b / 2**30:.2f} GiB" for b in LAYOUTS.values())
        print(f"| {label} | {peak} | {sizes} |")
    print(f"ratio private / forked: {rows[1][1] / rows[0][1]:.1f}x")


if __name__ == "__main__":
    main()
