"""Manager overhead: graph insertion, objective deduction and scheduling, on one core.

Usage: python benchmarks/manager_overhead.py [--engines 64] [--sessions 100] [--calls 10000] [--repeats 3]
    [--mix]

The manager runs in-process with fake engines that answer instantly (one
token), so everything measured is the manager's own work: validating and
inserting each call into its session's DAG, prefix hashing, deducing
objectives, scheduling rounds (Algorithm 1), and driving the engine API.
Each session submits map-reduce groups (8 maps feeding one reduce whose
output is fetched with LATENCY), one call per event-loop iteration, as calls
arriving over HTTP would.  Reported: submit->dispatch latency of calls whose
inputs were ready at submit (p50/p99), and calls per second from the first
submit to the last call finished.

Sessions belong to one tenant per :data:`SESSIONS_PER_TENANT`.  With ``--mix`` the
sessions take turns over four kinds of application: the
map-reduce group, a chain of four calls (each reads the previous output), a
single chat call read with LATENCY, and a call under a 1,500-character system
prompt shared by every session (prefix affinity).  Also reported: the manager's
CPU time per call (the process's CPU time over the run, which is the manager's
alone: the engines do nothing), the resident memory the run added per session
(every session keeps its calls' graph until it is closed; none is closed here),
and the rate at which the manager saturates (calls/s, since calls are submitted
as fast as the loop takes them).

``--virtual COST`` runs the same calls on simulated engines instead
(:class:`~parrot.sim.engine.SimEngine` with the step cost and KV pool of profile
``COST``, as ``python -m benchmarks.sim --cost`` takes it), in virtual time
(:mod:`parrot.sim.clock`): every call is submitted at virtual time 0, the engines
batch and compute them as the cost model says, and the run also reports the
virtual time until the last call finished and each kind of application's mean
latency (virtual seconds from its first submit to its last call's end).  Wall
time and CPU time are then the manager's and the simulated engines' bookkeeping
together (their planning, not their forward passes): an upper bound on the
manager's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk, PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim import clock as sim_clock
from parrot.sim.cost import CostProfile, load_profile
from parrot.sim.engine import SimEngine

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
        *,
        priority: int = 0,
        retain: bool = False,
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


SYSTEM = "You are the support desk of a large library; answer from its rules. " * 21  # ~1,500 chars
KINDS = ("map_reduce", "chain", "chat", "shared_prompt")


def single_call(template: str, **inputs: str) -> SubmitCall:
    bindings = [PlaceholderBinding(name=k, value=v) for k, v in inputs.items()]
    out = PlaceholderBinding(name="y", sampling={"max_tokens": 32}, criteria="LATENCY")
    return SubmitCall(template=template + " {{output:y}}", placeholders=[*bindings, out], name="single")


def chain_call(step: int, previous: str | None) -> SubmitCall:
    if previous is None:
        return single_call("Step 1: outline the {{input:topic}}.", topic="report")
    return SubmitCall(
        template=f"Step {step + 1}: improve this: {{{{input:prev}}}} Result: {{{{output:y}}}}",
        placeholders=[
            PlaceholderBinding(name="prev", var_id=previous),
            PlaceholderBinding(name="y", sampling={"max_tokens": 32}, criteria="LATENCY"),
        ],
        name="chain",
    )


def _group(kind: str, group: int, room: int) -> list:
    """The calls of one application of ``kind`` (at most ``room``), as functions of the
    output variable ids submitted so far in the group."""
    if kind == "map_reduce":
        maps = [lambda outs, i=i: map_call(i) for i in range(min(GROUP, room))]
        return maps + ([lambda outs: reduce_call(outs)] if room > GROUP else [])
    if kind == "chain":
        return [lambda outs, k=k: chain_call(k, outs[-1] if outs else None) for k in range(min(4, room))]
    if kind == "chat":
        return [lambda outs: single_call("User: {{input:q}} Assistant:", q=f"question {group}")]
    return [lambda outs: single_call(SYSTEM + " Query: {{input:q}}", q=f"query {group}")]


SESSIONS_PER_TENANT = 1000
"""Sessions per tenant: many sessions are many tenants' (each tenant may hold 4,096 by
default), so a large run also exercises the fair queuing between tenants."""


def tenants_for(n_sessions: int) -> int:
    return max(1, -(-n_sessions // SESSIONS_PER_TENANT))


def _rss_bytes() -> int:
    """The process's resident memory now (Linux), else its peak (ru_maxrss)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def run_once(
    n_engines: int, n_sessions: int, n_calls: int, mix: bool = False, profile: CostProfile | None = None
) -> dict[str, float]:
    """One run; ``profile``: simulated engines of that profile (run it under
    :func:`parrot.sim.clock.run`), else instant ones."""
    manager = Manager(ManagerConfig())
    tokenizer = TextTokenizer.byte_level_tiny()
    for i in range(n_engines):
        if profile is None:
            manager.pool.register(InstantEngine(tokenizer))
        else:
            engine = SimEngine(
                tokenizer,
                profile.cost,
                model_name="fake",
                answer_seed=i,
                max_seq_len=4096,
                kv_cache_tokens=profile.kv_cache_tokens,
            )
            manager.pool.register(engine)
    if profile is not None:
        await manager.poll_engine_stats()  # the engines' caps, before the first call
    rss0 = _rss_bytes()
    tenants = tenants_for(n_sessions)
    sessions = [manager.create_session(f"tenant{i % tenants}")[0] for i in range(n_sessions)]
    calls = []
    apps: list[tuple[str, list]] = []  # (kind, its calls)
    t0, cpu0 = time.perf_counter(), time.process_time()
    submitted = 0
    group = 0
    while submitted < n_calls:
        session = sessions[group % n_sessions]
        kind = KINDS[group % len(KINDS)] if mix else "map_reduce"
        outs: list[str] = []
        app_calls = []
        for make in _group(kind, group, n_calls - submitted):
            call = manager.submit_call(session, make(outs))
            app_calls.append(call)
            outs.append(next(iter(call.outputs.values())).var.var_id)
            submitted += 1
            await asyncio.sleep(0)  # one call per loop iteration, as over HTTP
        calls += app_calls
        apps.append((kind, app_calls))
        group += 1
    pending = 0  # calls before it have ended (they mostly end in order)
    while pending < len(calls):
        if calls[pending].state in ("done", "failed"):
            pending += 1
        else:
            await asyncio.sleep(0.001 if profile is None else 0.05)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rss = _rss_bytes() - rss0
    failed = [c for c in calls if c.state == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} calls failed, e.g. {failed[0].error!r}")
    delays = sorted((c.dispatched_at - c.submitted_at) * 1000 for c in calls if c.name == "map")
    await manager.executor.drain()
    out = {
        "calls_per_s": len(calls) / elapsed,
        "p50_ms": delays[len(delays) // 2],
        "p99_ms": delays[int(len(delays) * 0.99)],
        "rounds": manager.executor.rounds,
        "cpu_us_per_call": cpu / len(calls) * 1e6,
        "kib_per_session": rss / n_sessions / 1024,
        "calls": len(calls),
    }
    if profile is not None:
        out["virtual_s"] = max(c.finished_at for c in calls) - min(c.submitted_at for c in calls)
        for kind in KINDS:
            latencies = [max(c.finished_at for c in cs) - cs[0].submitted_at for k, cs in apps if k == kind]
            if latencies:
                out[f"{kind}_s"] = statistics.fmean(latencies)
        for handle in manager.pool:
            await handle.api.close()  # type: ignore[attr-defined] - a SimEngine's step loop
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mix", action="store_true", help="map-reduce, chains, chats and a shared system prompt")
    ap.add_argument(
        "--virtual",
        metavar="COST",
        default=None,
        help="simulated engines of this cost profile (a name or a file, as python -m benchmarks.sim "
        "--cost takes), in virtual time",
    )
    args = ap.parse_args()
    profile = None
    if args.virtual is not None:
        try:
            profile = load_profile(args.virtual)
        except ValueError as exc:
            ap.error(str(exc))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores (the manager uses one), "
        f"Python {platform.python_version()}"
    )
    apps = "a mix of map-reduce, chain, chat and shared-prompt apps" if args.mix else "map-reduce groups"
    engines = "fake engines" if profile is None else f"engines simulated as {profile.name}, in virtual time"
    print(
        f"{args.calls} calls in {args.sessions} sessions of {tenants_for(args.sessions)} tenant(s) "
        f"over {args.engines} {engines}, {apps}"
    )

    def one() -> dict[str, float]:
        run = run_once(args.engines, args.sessions, args.calls, args.mix, profile)
        return asyncio.run(run) if profile is None else sim_clock.run(run)

    results = [one() for _ in range(args.repeats)]
    keys = ("calls_per_s", "p50_ms", "p99_ms", "cpu_us_per_call", "kib_per_session")
    # in virtual time a call's submit->dispatch delay is the executor's virtual round timer, not work
    shown = keys if profile is None else ("calls_per_s", "cpu_us_per_call", "kib_per_session")
    columns = {  # key: (title, format)
        "calls_per_s": ("calls/s", ".0f"),
        "p50_ms": ("submit->dispatch p50 (ms)", ".3f"),
        "p99_ms": ("p99 (ms)", ".3f"),
        "cpu_us_per_call": ("CPU per call (µs)", ".0f"),
        "kib_per_session": ("KiB per session", ".1f"),
    }
    print("| run | " + " | ".join(columns[k][0] for k in shown) + " | scheduling rounds |")
    print("|---|" + "---|" * (len(shown) + 1))
    for i, r in enumerate(results, 1):
        print(f"| {i} | " + " | ".join(format(r[k], columns[k][1]) for k in shown) + f" | {r['rounds']} |")
    med = {k: statistics.median(r[k] for r in results) for k in keys}
    print("| median | " + " | ".join(format(med[k], columns[k][1]) for k in shown) + " | |")
    if profile is not None:
        kinds = [k for k in KINDS if f"{k}_s" in results[0]]
        print("\nIn virtual time (seconds; an application from its first submit to its last call's end):\n")
        print("| run | all calls done | " + " | ".join(f"{k} apps, mean" for k in kinds) + " |")
        print("|---|---|" + "---|" * len(kinds))
        for i, r in enumerate(results, 1):
            print(f"| {i} | {r['virtual_s']:.1f} | " + " | ".join(f"{r[f'{k}_s']:.2f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
