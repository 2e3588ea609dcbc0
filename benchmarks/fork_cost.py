"""Does a call that shares its prompt's prefix run slower than the same call from scratch?

    python benchmarks/fork_cost.py [--model smollm2] [--prompt-tokens 424] [--shared-tokens 400]
        [--max-tokens 100] [--repeats 5] [--threads 2]

One in-process engine (a :class:`LocalEngine`, as ``parrot serve`` embeds it) runs the
same call — ``--prompt-tokens`` prompt tokens, then ``--max-tokens`` greedy tokens — in
three ways, interleaved within each repeat (the order rotates) so that drift hits all
alike:

* ``scratch``: the whole prompt computed in a fresh context (another engine, prefix
  cache off, so nothing is reused);
* ``cached``: the first ``--shared-tokens`` tokens taken from the prefix cache (an
  earlier call with the same prefix computed them), the rest computed;
* ``forked``: the call's context forked from a parent context holding the first
  ``--shared-tokens`` tokens (the paper's ``Fill(tokens, ctx, parent_ctx)``), the
  rest filled in the child.

Per way: median wall time of fill + generate, of the fill alone, and of the decode
steps (time per output token after the first), with the ratio to ``scratch`` (> 1:
slower than from scratch).  Each repeat uses fresh random tokens, so ``cached``
reuses only what that repeat's warm-up call left.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

import torch

from parrot.engine.kernels.options import KernelOptions
from parrot.engine.loader import load_model
from parrot.engine.local import LocalEngine
from parrot.protocol.sampling import SamplingParams

_ids = itertools.count(1)


async def one_call(engine: LocalEngine, tokens: list[int], sp: SamplingParams, parent: int | None = None):
    """(total s, fill s, seconds per token after the first) of fill + generate in a new context."""
    ctx = next(_ids)
    t0 = time.perf_counter()
    await engine.fill(tokens, ctx, parent)
    t_fill = time.perf_counter()
    first = last = None
    n = 0
    async for chunk in engine.generate(sp, ctx):
        now = time.perf_counter()
        first = first or now
        last = now
        n += len(chunk.token_ids)
    await engine.free_context(ctx)
    per_token = (last - first) / max(n - 1, 1) if first is not None else float("nan")
    return last - t0, t_fill - t0, per_token


async def run(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)
    cached_engine = LocalEngine(loaded, kernels=KernelOptions.from_env())
    scratch_engine = LocalEngine(loaded, prefix_cache=False, kernels=KernelOptions.from_env())
    vocab = loaded.config.vocab_size
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    results: dict[str, list[tuple[float, float, float]]] = {"scratch": [], "cached": [], "forked": []}
    ways = list(results)
    for r in range(-1, args.repeats):  # repeat -1 warms up
        shared = [rng.randrange(100, vocab) for _ in range(args.shared_tokens)]
        rest = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens - args.shared_tokens)]
        # the warm-up call that leaves the shared prefix in the cache (a different suffix)
        await one_call(cached_engine, shared + [rng.randrange(100, vocab) for _ in range(8)], sp)
        parent = next(_ids)
        await cached_engine.fill(shared, parent)
        order = ways[r % 3 :] + ways[: r % 3] if r >= 0 else ways
        for way in order:
            if way == "scratch":
                got = await one_call(scratch_engine, shared + rest, sp)
            elif way == "cached":
                got = await one_call(cached_engine, shared + rest, sp)
            else:
                got = await one_call(cached_engine, rest, sp, parent=parent)
            if r >= 0:
                results[way].append(got)
                print(
                    f"repeat {r} {way:8s}: total {got[0]:6.2f} s, fill {got[1] * 1e3:6.0f} ms, "
                    f"{got[2] * 1e3:5.1f} ms/token",
                    flush=True,
                )
        await cached_engine.free_context(parent)
    base = [statistics.median(x[i] for x in results["scratch"]) for i in range(3)]
    print(
        f"\nmedians over {args.repeats} repeats ({args.prompt_tokens}-token prompt, "
        f"{args.shared_tokens} shared, {args.max_tokens} output tokens):"
    )
    for way, rows in results.items():
        med = [statistics.median(x[i] for x in rows) for i in range(3)]
        ratios = " / ".join(f"{m / b:.2f}x" for m, b in zip(med, base, strict=True))
        print(
            f"  {way:8s} total {med[0]:6.2f} s, fill {med[1] * 1e3:6.0f} ms, {med[2] * 1e3:5.1f} ms/token"
            f"   (vs scratch: {ratios})"
        )
    cached_engine.close()
    scratch_engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=424)
    ap.add_argument("--shared-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not 0 < args.shared_tokens < args.prompt_tokens:
        ap.error("need 0 < --shared-tokens < --prompt-tokens")
    torch.set_num_threads(args.threads)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
