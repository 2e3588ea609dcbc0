"""What one TLS context per process saves a client that opens a session per app.

    python -m parrot.cli serve --port 50112 --model .peers/models/smollm2 --weight-dtype bfloat16 \
        --kv-dtype bfloat16 --threads 2 &
    python -m benchmarks.sdk_tls_ab http://127.0.0.1:50112

Runs fig. 15/16's 32 concurrent apps (batch 32; ``benchmarks.suite``'s Parrot client, no
emulated delay) against the server, four times each way, alternating: the SDK's and the
suite's HTTP clients sharing one TLS context (as shipped, :func:`parrot.protocol.tls.tls_context`)
or building one per client (httpx's default, which loads the CA bundle each time).  The
client runs on the server's cores, as in the suite.  Prints the apps' mean and last
latency per run and the ratio of the means.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import benchmarks.suite.clients as clients
import httpx
from benchmarks.suite import workloads
from benchmarks.suite.clients import Delay, run_parrot_app

import parrot.frontend.async_session as async_session
from parrot.protocol.tls import tls_context

URL = sys.argv[1]
WORKLOAD = next(w for w in workloads.fig15_16(1.0, 0) if w.name.startswith("fig15_16/batch=32"))


def use(shared: bool) -> None:
    """Point the SDK's session and the suite's graph fetch at the shared context or a new one per client."""
    make = tls_context if shared else httpx.create_ssl_context
    async_session.tls_context = make
    clients.tls_context = make


async def once() -> tuple[float, float]:
    """(mean, last) latency of the workload's apps, all started at once."""
    t0 = time.perf_counter()
    recs = await asyncio.gather(*(run_parrot_app(URL, a, t0, Delay(0, 0)) for a in WORKLOAD.apps))
    assert not any(r.error for r in recs), [r.error for r in recs if r.error]
    ends = [r.end_s - r.start_s for r in recs]
    return statistics.mean(ends), max(ends)


async def main() -> None:
    use(True)
    await once()  # warm-up: the system prompt cached
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(4):
        for shared in (True, False) if r % 2 else (False, True):
            use(shared)
            res[shared].append(await once())
    for shared, rows in res.items():
        label = "one context per process" if shared else "one context per client "
        print(label, " ".join(f"mean {m:.2f} s / last {last:.2f} s" for m, last in rows))
    ratio = [b[0] / a[0] for a, b in zip(res[True], res[False], strict=True)]
    print("mean latency, per-client / shared:", " ".join(f"{x:.2f}x" for x in ratio))


if __name__ == "__main__":
    asyncio.run(main())
