"""Manager overhead: graph insertion, objective deduction and scheduling, on one core.

Usage: python benchmarks/manager_overhead.py [--engines 64] [--sessions 100] [--calls 10000] [--repeats 3]

The manager runs in-process with fake engines that answer instantly (one
token), so everything measured is the manager's own work: validating and
inserting each call into its session's DAG, prefix hashing, deducing
objectives, scheduling rounds (Algorithm 1), and driving the engine API.
Each session submits map-reduce groups (8 maps feeding one reduce whose
output is fetched with LATENCY), one call per event-loop iteration, as calls
arriving over HTTP would.  Reported: submit->dispatch latency of calls whose
inputs were ready at submit (p50/p99), and calls per second from the first
submit to the last call finished.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator, Sequence

from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk, PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer

GROUP = 8  # maps per reduce


class InstantEngine:
    """An engine that fills instantly and generates one token."""

    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer

    model_name = "fake"
    max_seq_len = 4096

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
    ) -> None:
        return None

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(token_ids=[65], text="A", done=True, finish_reason="length")

    async def free_context(self, context_id: int) -> None:
        return None

    async def stats(self) -> EngineStats:
        return EngineStats(token_capacity=65536)


def map_call(i: int) -> SubmitCall:
    return SubmitCall(
        template="You summarise documents for a busy reader. Part {{input:i}} of the report: {{output:s}}",
        placeholders=[
            PlaceholderBinding(name="i", value=str(i)),
            PlaceholderBinding(name="s", sampling={"max_tokens": 32}),
        ],
        name="map",
    )


def reduce_call(var_ids: list[str]) -> SubmitCall:
    parts = " ".join(f"{{{{input:p{k}}}}}" for k in range(len(var_ids)))
    return SubmitCall(
        template=f"Combine the parts: {parts} Summary: {{{{output:out}}}}",
        placeholders=[
            *(PlaceholderBinding(name=f"p{k}", var_id=v) for k, v in enumerate(var_ids)),
            PlaceholderBinding(name="out", sampling={"max_tokens": 64}, criteria="LATENCY"),
        ],
        name="reduce",
    )


async def run_once(n_engines: int, n_sessions: int, n_calls: int) -> dict[str, float]:
    manager = Manager(ManagerConfig())
    tokenizer = TextTokenizer.byte_level_tiny()
    for _ in range(n_engines):
        manager.pool.register(InstantEngine(tokenizer))
    sessions = [manager.create_session()[0] for _ in range(n_sessions)]
    calls = []
    t0 = time.perf_counter()
    submitted = 0
    group = 0
    while submitted < n_calls:
        session = sessions[group % n_sessions]
        outs = []
        for i in range(min(GROUP, n_calls - submitted)):
            call = manager.submit_call(session, map_call(i))
            calls.append(call)
            outs.append(call.outputs["s"].var.var_id)
            submitted += 1
            await asyncio.sleep(0)  # one call per loop iteration, as over HTTP
        if submitted < n_calls:
            calls.append(manager.submit_call(session, reduce_call(outs)))
            submitted += 1
            await asyncio.sleep(0)
        group += 1
    while any(c.state not in ("done", "failed") for c in calls):
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    failed = [c for c in calls if c.state == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} calls failed, e.g. {failed[0].error!r}")
    delays = sorted((c.dispatched_at - c.submitted_at) * 1000 for c in calls if c.name == "map")
    await manager.executor.drain()
    return {
        "calls_per_s": len(calls) / elapsed,
        "p50_ms": delays[len(delays) // 2],
        "p99_ms": delays[int(len(delays) * 0.99)],
        "rounds": manager.executor.rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores (the manager uses one), "
        f"Python {platform.python_version()}"
    )
    print(
        f"{args.calls} calls in {args.sessions} sessions over {args.engines} fake engines, "
        f"map-reduce groups of {GROUP}+1"
    )
    results = [asyncio.run(run_once(args.engines, args.sessions, args.calls)) for _ in range(args.repeats)]
    print("| run | calls/s | submit->dispatch p50 (ms) | p99 (ms) | scheduling rounds |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(results, 1):
        print(f"| {i} | {r['calls_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['rounds']} |")
    med = {k: statistics.median(r[k] for r in results) for k in ("calls_per_s", "p50_ms", "p99_ms")}
    print(f"| median | {med['calls_per_s']:.0f} | {med['p50_ms']:.3f} | {med['p99_ms']:.3f} | |")


if __name__ == "__main__":
    main()
