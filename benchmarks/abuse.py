"""Abuse cases against a live Parrot cluster on loopback; prints a table.

Starts a manager (``parrot serve``, embedded engine) with two tenants' API keys
and low quotas, plus one ``parrot engine`` process registered with the cluster
secret, then runs each attack of the security issue as a hostile tenant
("mallory") would, while a bystander tenant ("alice") runs one short call
beside it.  Each row: the statuses the attack got, the longest ``/healthz``
answer while it ran, the bystander's call latency, whether anything of another
tenant or of the cluster leaked, and how many accepted calls were lost (a
bystander call that did not end ready).

    python -m benchmarks.abuse                 # SmolLM2 (the default model)
    python -m benchmarks.abuse --model tiny    # a seeded random-weight model: quick

Targets: no 5xx, no ``/healthz`` stall over 1 s, nothing leaked, no accepted call
lost.  Every process started is stopped on exit, Ctrl-C or SIGTERM included.
Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from benchmarks.suite.systems import _free_port, _healthy, _Process, _wait, parrot_command

from parrot.protocol.cluster import CLUSTER_SECRET_ENV, CLUSTER_SECRET_HEADER, generate_secret

MALLORY = "mallory-key-" + "0123456789abcdef"
ALICE = "alice-key-" + "fedcba9876543210"
QUOTA_CALLS = 300
QUOTA_SESSIONS = 64
QUOTA_VALUE_BYTES = 8 * 1024 * 1024
SYSTEM_PROMPT = (
    "You are the assistant of a small bakery. Answer questions about opening hours, bread, "
    "cakes and orders politely and briefly. The bakery opens at seven and closes at six. "
) * 3
HEALTH_POLL_S = 0.02
WAIT_S = 120.0


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def output(max_tokens: int = 4, **extra) -> dict:
    return {
        "name": "y",
        "direction": "output",
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


@dataclass
class Row:
    case: str
    statuses: list[int | str] = field(default_factory=list)
    stall_s: float = 0.0
    bystander_s: float | None = None
    leaked: bool | None = None
    lost: int = 0
    note: str = ""

    def status_text(self) -> str:
        counts: dict[str, int] = {}
        for s in self.statuses:
            counts[str(s)] = counts.get(str(s), 0) + 1
        return ", ".join(f"{s}" if n == 1 else f"{s} x{n}" for s, n in counts.items())


class Cluster:
    """The manager URL, the engine process's URL, the operator's headers."""

    def __init__(self, url: str, engine_url: str, secret: str, manager_pid: int):
        self.url = url
        self.engine_url = engine_url
        self.operator = {CLUSTER_SECRET_HEADER: secret}
        self.manager_pid = manager_pid


class HealthProbe:
    """Polls ``/healthz`` all along; :meth:`longest_since` is the slowest answer since a mark."""

    def __init__(self, url: str):
        self.url = url
        self.samples: list[tuple[float, float]] = []  # (when it was asked, seconds it took)
        self._task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30, trust_env=False) as http:
            while True:
                asked = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    await http.get("/healthz")
                self.samples.append((asked, time.monotonic() - asked))
                await asyncio.sleep(HEALTH_POLL_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def longest_since(self, mark: float) -> float:
        return max((took for asked, took in self.samples if asked + took >= mark), default=0.0)


async def open_session(http: httpx.AsyncClient, key: str) -> tuple[str, dict[str, str]]:
    resp = await http.post("/v1/sessions", headers=bearer(key))
    resp.raise_for_status()
    body = resp.json()
    return f"/v1/sessions/{body['session_id']}", bearer(body["token"])


@contextlib.asynccontextmanager
async def attacker_session(http: httpx.AsyncClient) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Mallory's session (its path and token header), closed however the attack ends."""
    path, auth = await open_session(http, MALLORY)
    try:
        yield path, auth
    finally:
        await http.delete(path, headers=auth)


async def run_call(
    http: httpx.AsyncClient, key: str, template: str, placeholders: list[dict]
) -> tuple[dict, dict]:
    """Open a session, run one call to its end; (its call info, its output variable)."""
    path, auth = await open_session(http, key)
    try:
        resp = await http.post(
            f"{path}/calls", json={"template": template, "placeholders": placeholders}, headers=auth
        )
        resp.raise_for_status()
        ids = resp.json()
        var = (
            await http.get(f"{path}/variables/{ids['outputs']['y']}", params={"wait": 60}, headers=auth)
        ).json()
        info = (await http.get(f"{path}/calls/{ids['call_id']}", headers=auth)).json()
        return info, var
    finally:
        await http.delete(path, headers=auth)


async def bystander(http: httpx.AsyncClient) -> tuple[float, bool]:
    """Alice's short call: (seconds to its value, whether it ended ready)."""
    started = time.monotonic()
    _, var = await run_call(
        http, ALICE, "Q: {{input:x}}\nA:{{output:y}}", [{"name": "x", "value": "hi"}, output()]
    )
    return time.monotonic() - started, var.get("state") == "ready"


Attack = Callable[[Cluster, httpx.AsyncClient, Row], Awaitable[None]]


# ------------------------------------------------------------------ attacks
async def unauthenticated_registration(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    body = {"url": "http://127.0.0.1:1", "model": "tiny", "max_seq_len": 64}
    row.statuses.append((await http.post("/v1/engines", json=body)).status_code)
    engines = (await http.get("/v1/engines")).json()
    row.leaked = len(engines) != 2  # a fake engine joined


async def poisoned_heartbeat(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    engines = (await http.get("/v1/engines")).json()
    bad = {"stats": {"token_capacity": -1}}
    for e in engines:
        row.statuses.append(
            (await http.post(f"/v1/engines/{e['engine_id']}/heartbeat", json=bad)).status_code
        )
        resp = await http.post(f"/v1/engines/{e['engine_id']}/heartbeat", json=bad, headers=c.operator)
        row.statuses.append(resp.status_code)
    row.note = "without the secret, then with it (a bad payload)"


async def open_engine_api(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    async with httpx.AsyncClient(base_url=c.engine_url, timeout=30, trust_env=False) as eng:
        for path, body in (
            ("/fill", {"tokens": [1, 2, 3], "context_id": 1}),
            ("/generate", {"sampling": {}, "context_id": 1}),
            ("/free_context", {"context_id": 1}),
        ):
            row.statuses.append((await eng.post(path, json=body)).status_code)
        for path in ("/stats", "/tokenizer"):
            row.statuses.append((await eng.get(path)).status_code)


async def public_engine_list(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    resp = await http.get("/v1/engines")
    row.statuses.append(resp.status_code)
    counters = ("filled_tokens", "cached_tokens", "generated_tokens", "num_running")
    row.leaked = any(e.get("url") or any(e["stats"].get(k) for k in counters) for e in resp.json())


async def no_or_wrong_key(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    for headers in ({}, bearer("guess-" + "0" * 20)):
        row.statuses.append((await http.post("/v1/sessions", headers=headers)).status_code)
        resp = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        row.statuses.append(resp.status_code)


async def another_tenants_session(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    path, auth = await open_session(http, ALICE)
    try:
        resp = await http.post(f"{path}/variables", json={"value": "alice's secret"}, headers=auth)
        var = resp.json()["var_id"]
        for headers in (bearer(MALLORY), {}):
            got = await http.get(f"{path}/variables/{var}", headers=headers)
            row.statuses.append(got.status_code)
            row.leaked = bool(row.leaked) or "secret" in got.text
        row.statuses.append((await http.delete(path, headers=bearer(MALLORY))).status_code)
    finally:
        await http.delete(path, headers=auth)


async def guessed_prefix(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    """Alice runs a prompt behind a long system prompt; mallory guesses it.  Leaked if
    mallory's call is placed for the prefix or any engine reuses cached tokens for it."""
    template = SYSTEM_PROMPT + "{{input:x}}\nA:{{output:y}}"
    binding = [{"name": "x", "value": "When do you open?"}, output(2)]
    await run_call(http, ALICE, template, binding)

    async def cached() -> int:
        engines = (await http.get("/v1/engines", headers=c.operator)).json()
        return sum(e["stats"]["cached_tokens"] for e in engines)

    before = await cached()
    info, var = await run_call(http, MALLORY, template, binding)
    row.statuses.append(var["state"])
    row.leaked = info["placement"] in ("prefix-engine", "prefix-spill") or await cached() != before
    row.note = f"placement {info['placement']}"


async def backtracking_regex(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    template = (
        "Write the letter a forty times in a row, then a period: aaaaaaaaaaaaaaaaaaaa{{input:x}}{{output:y}}"
    )
    transform = [{"kind": "regex", "pattern": "(a|aa)+$"}]
    started = time.monotonic()
    _, var = await run_call(
        http, MALLORY, template, [{"name": "x", "value": "aaaa"}, output(40, transform=transform)]
    )
    row.statuses.append((var.get("error") or {}).get("code") or var["state"])
    row.note = f"call ended in {time.monotonic() - started:.1f} s"


async def many_placeholders(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    names = [f"v{i}" for i in range(1023)]
    template = "".join(f"{{{{input:{names[i % len(names)]}}}}}" for i in range(66_000)) + "{{output:y}}"
    bindings = [{"name": n, "direction": "input", "value": "x"} for n in names] + [output()]
    async with attacker_session(http) as (path, auth):
        started = time.monotonic()
        resp = await http.post(
            f"{path}/calls", json={"template": template, "placeholders": bindings}, headers=auth
        )
        row.statuses.append(resp.status_code)
        row.note = f"answered in {time.monotonic() - started:.2f} s"


async def huge_value(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    async with attacker_session(http) as (path, auth):
        value = "lorem ipsum dolor sit amet " * 290_000  # 7.8 MB
        resp = await http.post(f"{path}/variables", json={"value": value}, headers=auth)
        row.statuses.append(resp.status_code)
        row.note = f"{len(value) / 1e6:.1f} MB value"


async def malformed_bodies(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    async with attacker_session(http) as (path, auth):
        lone = '{"template": "x \\ud800 {{output:y}}", "placeholders": []}'
        headers = {**auth, "content-type": "application/json"}
        row.statuses.append((await http.post(f"{path}/calls", content=lone, headers=headers)).status_code)
        body = {"template": "x {{output:y}}", "placeholders": [output()], "chat": "yes"}
        row.statuses.append((await http.post(f"{path}/calls", json=body, headers=auth)).status_code)
        stops = output(4)
        stops["sampling"]["stop_token_ids"] = list(range(1_000_000))
        body = {"template": "x {{output:y}}", "placeholders": [stops]}
        row.statuses.append((await http.post(f"{path}/calls", json=body, headers=auth)).status_code)
        big = b"{" + b" " * (9 * 1024 * 1024) + b"}"
        row.statuses.append((await http.post(f"{path}/calls", content=big, headers=headers)).status_code)
        row.note = "lone surrogate, chat: 'yes', 10^6 stop token ids, a 9 MiB body"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def rejected_templates(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    async with attacker_session(http) as (path, auth):
        before = rss_mb(c.manager_pid)
        for i in range(40):
            template = f"{i} " + "{{bad " * 170_000  # ~1 MB, never a valid template
            body = {"template": template, "placeholders": [output()]}
            row.statuses.append((await http.post(f"{path}/calls", json=body, headers=auth)).status_code)
        row.note = f"manager RSS {before:.0f} -> {rss_mb(c.manager_pid):.0f} MB"


async def call_flood(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    """Mallory queues more calls than its quota in batches; alice's call runs meanwhile."""
    async with attacker_session(http) as (path, auth):
        call = {"op": "submit_call", "template": "Q: {{input:x}}\nA:{{output:y}}", "placeholders": []}
        accepted = 0
        for b in range(QUOTA_CALLS // 50 * 2):
            ops = [
                {**call, "placeholders": [{"name": "x", "value": f"{b}-{i}"}, output(1)]} for i in range(50)
            ]
            resp = await http.post(f"{path}/batch", json={"ops": ops}, headers=auth)
            row.statuses.append(resp.status_code)
            if resp.status_code == 200:
                accepted += 50
            elif resp.status_code == 429:
                row.note = f"{accepted} calls accepted; Retry-After {resp.headers.get('retry-after')}"


async def session_and_value_quotas(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    """Sessions past the session quota, then batches of 4 KiB values past the byte quota."""
    opened = []
    try:
        for _ in range(QUOTA_SESSIONS + 8):
            resp = await http.post("/v1/sessions", headers=bearer(MALLORY))
            row.statuses.append(resp.status_code)
            if resp.status_code == 201:
                body = resp.json()
                opened.append((f"/v1/sessions/{body['session_id']}", bearer(body["token"])))
        path, auth = opened[0]
        ops = [{"op": "create_variable", "value": "v" * 4096}] * 1500  # 6 MB a batch
        for _ in range(QUOTA_VALUE_BYTES // (4096 * 1500) + 1):
            resp = await http.post(f"{path}/batch", json={"ops": ops}, headers=auth)
            row.statuses.append(resp.status_code)
        quotas = f"quotas {QUOTA_SESSIONS} sessions, {QUOTA_VALUE_BYTES >> 20} MiB"
        row.note = f"{QUOTA_SESSIONS + 8} sessions, then batches of 1,500 4 KiB values ({quotas})"
    finally:
        for path, auth in opened:
            await http.delete(path, headers=auth)


async def abandoned_completion(c: Cluster, http: httpx.AsyncClient, row: Row) -> None:
    async def generated() -> int:
        engines = (await http.get("/v1/engines", headers=c.operator)).json()
        return sum(e["stats"]["generated_tokens"] for e in engines)

    body = {"prompt": "Tell a long story.", "max_tokens": 1500, "ignore_eos": True}
    try:
        await http.post("/v1/completions", json=body, headers=bearer(MALLORY), timeout=1.0)
        row.statuses.append("answered")
    except httpx.TimeoutException:
        row.statuses.append("client left")
    await asyncio.sleep(1.5)  # the manager notices within its poll interval
    settled = await generated()
    await asyncio.sleep(2.0)
    still = await generated() - settled
    row.leaked = None
    row.note = f"{still} tokens generated in the 2 s after (0: cancelled)"
    if still:
        row.statuses.append("still generating")


ATTACKS: list[tuple[str, Attack]] = [
    ("register an engine without the secret", unauthenticated_registration),
    ("heartbeat token_capacity -1", poisoned_heartbeat),
    ("engine API without the secret", open_engine_api),
    ("GET /v1/engines as anyone", public_engine_list),
    ("no API key / a wrong one", no_or_wrong_key),
    ("another tenant's session", another_tenants_session),
    ("guess another tenant's prompt prefix", guessed_prefix),
    ("backtracking regex transform", backtracking_regex),
    ("66,000 placeholders over 1,023 names", many_placeholders),
    ("a 7.8 MB value", huge_value),
    ("malformed bodies", malformed_bodies),
    ("40 rejected 1 MB templates", rejected_templates),
    (f"flood past the call quota ({QUOTA_CALLS})", call_flood),
    ("past the session and value quotas", session_and_value_quotas),
    ("a completion whose client leaves", abandoned_completion),
]


# ------------------------------------------------------------------ running
async def run_cases(cluster: Cluster) -> tuple[float, list[Row]]:
    probe = HealthProbe(cluster.url)
    probe.start()
    rows: list[Row] = []
    try:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=WAIT_S, trust_env=False) as http:
            await bystander(http)  # warm-up
            quiet = [(await bystander(http))[0] for _ in range(3)]
            for name, attack in ATTACKS:
                row = Row(name)
                mark = time.monotonic()
                beside = asyncio.create_task(bystander(http))
                try:
                    await attack(cluster, http, row)
                except httpx.HTTPError as exc:
                    row.statuses.append(f"error {type(exc).__name__}")
                seconds, ready = await beside
                row.bystander_s, row.lost = seconds, 0 if ready else 1
                row.stall_s = probe.longest_since(mark)
                rows.append(row)
                print(f"  {name}: {row.status_text()} ({row.note})", file=sys.stderr, flush=True)
    finally:
        await probe.stop()
    return sorted(quiet)[1], rows


def table(quiet_s: float, rows: list[Row]) -> str:
    lines = [
        f"Bystander's call alone (median of 3): {quiet_s:.2f} s",
        "",
        "| case | statuses | longest /healthz | bystander's call | leaked | lost | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        leaked = "n/a" if r.leaked is None else ("YES" if r.leaked else "no")
        lines.append(
            f"| {r.case} | {r.status_text()} | {r.stall_s:.2f} s | {r.bystander_s or 0:.2f} s | {leaked} | "
            f"{r.lost} | {r.note} |"
        )
    server_errors = sum(1 for r in rows for s in r.statuses if isinstance(s, int) and s >= 500)
    lines += [
        "",
        f"5xx answers: {server_errors}; longest /healthz: {max(r.stall_s for r in rows):.2f} s; "
        f"leaks: {sum(1 for r in rows if r.leaked)}; accepted calls lost: {sum(r.lost for r in rows)}",
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def started_cluster(model: str, log_dir: Path):
    secret = generate_secret()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {CLUSTER_SECRET_ENV: secret, "OMP_NUM_THREADS": "1"}
    serve = [*parrot_command(), "--log-level", "warning", "serve", "--port", str(port), "--model", model]
    serve += ["--threads", "1", "--api-key", f"mallory:{MALLORY}", "--api-key", f"alice:{ALICE}"]
    serve += ["--max-calls-per-tenant", str(QUOTA_CALLS), "--max-sessions-per-tenant", str(QUOTA_SESSIONS)]
    serve += ["--max-value-bytes-per-tenant", str(QUOTA_VALUE_BYTES)]
    engine = [*parrot_command(), "--log-level", "warning", "engine", "--manager", url, "--port", "0"]
    engine += ["--model", model, "--threads", "1", "--name", "remote"]
    procs: list[_Process] = []
    try:
        procs.append(_Process("manager", serve, log_dir / "manager.log", env))
        _wait(lambda: _healthy(url), "the manager", 300, procs)
        procs.append(_Process("engine", engine, log_dir / "engine.log", env))
        operator = {CLUSTER_SECRET_HEADER: secret}

        def engines() -> list[dict]:
            return httpx.get(f"{url}/v1/engines", headers=operator, timeout=5, trust_env=False).json()

        _wait(lambda: sum(e["alive"] for e in engines()) == 2, "the engine to register", 300, procs)
        engine_url = next(e["url"] for e in engines() if e["url"])
        yield Cluster(url, engine_url, secret, procs[0].popen.pid)
    finally:
        for proc in reversed(procs):
            proc.stop()


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="the engines' model (default: smollm2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    log_dir = Path(tempfile.mkdtemp(prefix="parrot-abuse-"))
    try:
        with started_cluster(args.model, log_dir) as cluster:
            quiet, rows = asyncio.run(run_cases(cluster))
    except (KeyboardInterrupt, _Terminated):
        print("interrupted: every process was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    header = [
        "# Abuse cases against a live cluster",
        "",
        f"`python -m benchmarks.abuse --model {args.model}` at commit {commit}, "
        f"{platform.machine()} with {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}. A manager with its "
        "embedded engine and one `parrot engine` process (one thread each), two tenants (mallory attacks, "
        f"alice runs one short call beside each attack), quotas {QUOTA_SESSIONS} sessions, {QUOTA_CALLS} "
        f"calls, {QUOTA_VALUE_BYTES >> 20} MiB of values per tenant.",
        "",
    ]
    report = "\n".join(header) + table(quiet, rows) + "\n"
    print(f"logs: {log_dir}", file=sys.stderr)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
