"""How an application of the suite runs against a system: Parrot's client or the baseline client.

Both clients run the same :class:`~benchmarks.suite.spec.AppSpec` and return an
:class:`~benchmarks.suite.spec.AppRecord`.  Times are seconds relative to the
workload start ``t0``, a :func:`time.perf_counter` reading shared by every app
of a workload.

Emulated network latency (the paper's section 5, "Emulated network latency"):
every HTTP request on an application's critical path pays one :class:`Delay`
(uniform 200-300 ms by default, seeded per app, so every system draws the same
sequence) in full, and nothing else does:

* Parrot (:func:`run_parrot_app`): one delay for the one request that opens
  the session, submits the whole app and fetches its outputs
  (``POST /v1/sessions`` carrying the app as a batch whose answer waits for
  the final outputs: ``P.aconnect(url, defer_open=True)`` and
  ``session.batch(fetch_outputs=True)``), slept before it is sent; its answer
  comes back as the baseline's streamed answers do, for nothing.  An output
  still pending when the manager's wait (60 s) ends is read with a ``get``,
  which pays one delay *after* the value arrived (the answer is in flight), so
  no delay overlaps with execution.  Values flowing between dependent calls
  stay inside the server and pay nothing.  An app pays 1 delay (the paper's
  client paid ``1 + k`` for ``k`` outputs: the submission, then each ``get``).
* Baseline (:func:`run_baseline_app`, LangChain-style): one delay per
  ``/v1/completions`` request, slept before the request is sent; a dependent
  call starts only after its producers' answers came back.  An app of ``n``
  calls pays ``n`` delays (parallel calls pay theirs side by side).

``AppRecord.delays`` / ``delay_s`` count what an app paid.  The baseline
streams every completion (``stream: true`` with ``stream_options:
{include_usage: true}``), so each call records when its first token and its
end reached the client; Parrot's calls get the same times from the session
graph (``first_token_at`` and ``finished_at``), plus when they became ready
and when the manager placed them (:class:`~benchmarks.suite.spec.CallRecord`).

With several servers (vLLM run as N engines), the baseline client sends each
request to the server with the fewest requests in flight, ties round-robin
(:class:`Router`), the paper's baseline dispatch.

Invariant: an app never raises out of these functions; its failure (any
exception, including a timeout) is recorded in ``AppRecord.error`` and the
workload goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

import parrot as P
from parrot.protocol.clock import TIME_HEADER
from parrot.protocol.tls import tls_context

from .spec import AppRecord, AppSpec, CallRecord, CallSpec, RunRecord, Workload

if TYPE_CHECKING:
    from .systems import SystemHandle

__all__ = [
    "Delay",
    "Router",
    "render_prompt",
    "run_baseline_app",
    "run_parrot_app",
    "run_workload",
]

_PLACEHOLDER = re.compile(r"\{\{(input|output):([A-Za-z_][A-Za-z0-9_]*)\}\}")
_ERROR_CHARS = 600
_SAMPLE_EVERY_S = 0.5
DEFAULT_APP_TIMEOUT_S = 3600.0


# ------------------------------------------------------------------ delay
class Delay:
    """Emulated network latency: each ``await delay()`` sleeps a uniform draw
    from ``[low_ms, high_ms]`` milliseconds and returns the seconds slept.

    Draws come from a private ``random.Random(seed)``, so the same seed gives
    the same sequence of delays.  ``Delay(0, 0)`` never sleeps.
    """

    def __init__(self, low_ms: float = 200.0, high_ms: float = 300.0, seed: int | str = 0):
        if low_ms < 0 or high_ms < low_ms:
            raise ValueError(f"need 0 <= low_ms <= high_ms, got {low_ms}, {high_ms}")
        self.low_ms = float(low_ms)
        self.high_ms = float(high_ms)
        self._rng = random.Random(seed)
        self.count = 0  # how many delays were paid
        self.total_s = 0.0

    def __repr__(self) -> str:
        return f"Delay({self.low_ms:g}-{self.high_ms:g} ms, paid {self.count})"

    def sample(self) -> float:
        """The next delay in seconds (advances the seeded sequence)."""
        return self._rng.uniform(self.low_ms, self.high_ms) / 1000.0

    async def __call__(self) -> float:
        seconds = self.sample()
        self.count += 1
        self.total_s += seconds
        if seconds > 0:
            await asyncio.sleep(seconds)
        return seconds


# ------------------------------------------------------------------ helpers
def _rel(t0: float) -> float:
    return time.perf_counter() - t0


async def _sleep_until(t0: float, offset_s: float) -> None:
    remaining = t0 + offset_s - time.perf_counter()
    if remaining > 0:
        await asyncio.sleep(remaining)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


def _criteria(app: AppSpec) -> str:
    return P.THROUGHPUT if app.criteria == "throughput" else P.LATENCY


def render_prompt(call: CallSpec, upstream: Mapping[str, str]) -> str:
    """The prompt the baseline sends for ``call``: its template up to (not
    including) ``{{output:<name>}}``, every ``{{input:x}}`` replaced by
    ``call.consts[x]`` or by the text of the call ``call.deps[x]`` in
    ``upstream``.  Substituted text is never re-scanned for placeholders."""
    marker = f"{{{{output:{call.name}}}}}"
    head, found, _ = call.template.partition(marker)
    if not found:
        raise ValueError(f"{call.name}: template has no {marker}")

    def value(match: re.Match[str]) -> str:
        kind, name = match.group(1), match.group(2)
        if kind != "input":
            raise ValueError(f"{call.name}: unexpected output placeholder {name!r} before its own")
        if name in call.consts:
            return call.consts[name]
        return upstream[call.deps[name]]

    return _PLACEHOLDER.sub(value, head)


# ------------------------------------------------------------------ Parrot
def _semantic_function(call: CallSpec, criteria: str | None) -> P.SemanticFunction:
    """``call`` as a semantic function: raw prompt (no chat wrapping), greedy, ``ignore_eos``."""
    output = P.Output(max_tokens=call.max_tokens, temperature=0.0, ignore_eos=True, criteria=criteria)
    return P.template_function(call.template, name=call.name, **{call.name: output})


async def _submit_app(session: P.AsyncSession, app: AppSpec) -> dict[str, P.SemanticVariable]:
    """Submit the whole of ``app`` on ``session`` in one batch request
    (dependencies as variables) whose answer brings the final outputs' values
    (``fetch_outputs``: it returns once they are in); returns the outputs by
    call, ids known.

    The batch creates every constant input as an empty variable, then submits
    every call, then sets the constant inputs.  The manager applies a batch as
    a whole before any call can be scheduled, and with the inputs set last, no
    call is ready before every call is linked, so the manager deduces objectives
    over the whole DAG before it places anything.
    """
    criteria = _criteria(app)
    variables: dict[str, P.SemanticVariable] = {}
    constants: list[tuple[P.SemanticVariable, str]] = []
    async with session.batch(fetch_outputs=True):
        for call in app.calls:
            inputs: dict[str, Any] = {}
            for ph, value in call.consts.items():
                var = session.variable(name=f"{call.name}.{ph}")
                constants.append((var, value))
                inputs[ph] = var
            inputs.update({ph: variables[dep] for ph, dep in call.deps.items()})
            fn = _semantic_function(call, criteria if call.name in app.outputs else None)
            out = session.call(fn, **inputs)
            assert isinstance(out, P.SemanticVariable)  # one output per call
            variables[call.name] = out
        for var, value in constants:
            await var.aset(value)
    return variables


async def _graph_records(session: P.AsyncSession, app: AppSpec, t0: float) -> list[CallRecord] | None:
    """Per-call records from ``GET /v1/sessions/{sid}/graph`` (server times mapped
    to the workload clock; tokens as the engine counted them); None if unavailable.

    A call's ``ready_s`` is when it was submitted or, if later, when the last
    of its producers finished (at most its ``start_s``: a producer's value is
    handed on a moment before the producer records its end); ``start_s`` when
    the manager placed it.  The manager's stamps are placed on the workload clock
    through the manager's own time as it answered (the ``X-Parrot-Time`` header),
    not through this process's wall clock: a system clock stepped while a long-lived
    manager runs moves the two apart."""
    if session.session_id is None or session.token is None:
        return None
    headers = {"Authorization": f"Bearer {session.token}"}
    try:
        async with httpx.AsyncClient(
            base_url=session.url, headers=headers, trust_env=False, verify=tls_context()
        ) as http:
            response = await http.get(f"/v1/sessions/{session.session_id}/graph", timeout=30.0)
        answered = _rel(t0)
        response.raise_for_status()
        calls = response.json()["calls"]
        server_now = float(response.headers[TIME_HEADER])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    offset = server_now - answered  # a manager stamp minus this offset is on the workload clock

    def rel(stamp: Any) -> float | None:
        return stamp - offset if isinstance(stamp, int | float) else None

    by_name = {c.get("name"): c for c in calls}
    records: dict[str, CallRecord] = {}
    for spec in app.calls:
        info = by_name.get(spec.name)
        if info is None:
            return None
        start = rel(info.get("started_at")) or rel(info.get("dispatched_at")) or rel(info.get("submitted_at"))
        end = rel(info.get("finished_at")) or start
        ready = rel(info.get("submitted_at"))
        for dep in spec.deps.values():
            produced = records[dep].end_s
            if ready is not None and math.isfinite(produced):
                ready = max(ready, produced)
        if ready is not None and start is not None:
            ready = min(ready, start)
        records[spec.name] = CallRecord(
            name=spec.name,
            start_s=start if start is not None else float("nan"),
            end_s=end if end is not None else float("nan"),
            prompt_tokens=info.get("prompt_tokens"),
            output_tokens=info.get("generated_tokens"),
            engine=info.get("engine_id"),
            ready_s=ready,
            first_token_s=rel(info.get("first_token_at")),
        )
    return list(records.values())


async def _fetch(var: P.SemanticVariable, criteria: str, delay: Delay, t0: float) -> float:
    """One final output: its value when the submission's answer brought it, else a ``get``
    that waits for the value, then pays the delay of the answer's trip; returns end time."""
    if var.is_ready:
        return _rel(t0)
    await var.aget(criteria)
    await delay()
    return _rel(t0)


async def run_parrot_app(url: str, app: AppSpec, t0: float, delay: Delay) -> AppRecord:
    """Run ``app`` on the Parrot manager at ``url`` the Parrot way.

    Waits until ``t0 + app.arrival_s``, pays one delay and opens a session
    with the whole app as its first batch, in one request: every call as a semantic
    function (dependencies as semantic variables, ``app.criteria`` on the
    outputs so the manager deduces objectives at submit), the constant inputs
    set last (see :func:`_submit_app`), the answer waiting for the final
    outputs; an output it did not bring is read with a ``get`` that pays one
    delay once its value is in.
    ``calls`` holds one record per call from the session graph (server-side
    times and token counts), or, if the graph is unavailable, one per fetched
    output with client-side times and no token counts.
    """
    await _sleep_until(t0, app.arrival_s)
    start = _rel(t0)
    record = AppRecord(app.app_id, app.kind, app.arrival_s, start, start)
    criteria = _criteria(app)
    done = False
    try:
        async with P.aconnect(url, defer_open=True) as session:
            await delay()  # the submission's network trip: nothing runs before it is over
            variables = await _submit_app(session, app)  # one request: the session and the whole DAG
            ends = await asyncio.gather(*(_fetch(variables[o], criteria, delay, t0) for o in app.outputs))
            record.end_s, done = max(ends, default=_rel(t0)), True
            graph = await _graph_records(session, app, t0)
            fallback = [CallRecord(o, start, end) for o, end in zip(app.outputs, ends, strict=True)]
            record.calls = graph or fallback
    except Exception as exc:
        if not done:
            record.end_s = _rel(t0)
        record.error = _describe(exc)
    record.delays, record.delay_s = delay.count, delay.total_s
    return record


# ------------------------------------------------------------------ baseline
class Router:
    """Request-level dispatch over servers: each request goes to the server with the
    fewest requests in flight (this client's), ties broken round-robin.

    Use ``with router.pick() as url:`` around a request."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("a router needs at least one server")
        self.urls = list(urls)
        self.in_flight = [0] * len(urls)
        self.sent = [0] * len(urls)  # requests each server got
        self._next = 0

    @contextlib.contextmanager
    def pick(self) -> Any:
        fewest = min(self.in_flight)
        n = len(self.urls)
        i = next(j % n for j in range(self._next, self._next + n) if self.in_flight[j % n] == fewest)
        self._next = (i + 1) % n
        self.in_flight[i] += 1
        self.sent[i] += 1
        try:
            yield self.urls[i]
        finally:
            self.in_flight[i] -= 1


async def _complete(
    client: httpx.AsyncClient, base_url: str, body: dict[str, Any], t0: float
) -> tuple[str, dict[str, Any], float | None]:
    """POST one streamed completion; returns (text, usage, time of the first text chunk).

    Raises RuntimeError on a non-2xx answer or an error event in the stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    url = f"{base_url.rstrip('/')}/v1/completions"
    text: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    async with client.stream("POST", url, json=body) as response:
        if not response.is_success:
            await response.aread()
            raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                raise RuntimeError(f"/v1/completions failed: {str(event['error'])[:300]}")
            for choice in event.get("choices") or ():
                piece = choice.get("text") or ""
                if piece:
                    if first is None:
                        first = _rel(t0)
                    text.append(piece)
            if event.get("usage"):
                usage = event["usage"]
    return "".join(text), usage, first


async def run_baseline_app(
    client: httpx.AsyncClient,
    base_url: str | Router,
    model: str,
    app: AppSpec,
    t0: float,
    delay: Delay,
    *,
    ignore_eos: bool = True,
) -> AppRecord:
    """Run ``app`` LangChain-style against an OpenAI ``/v1/completions`` server.

    The client renders every prompt itself (:func:`render_prompt`) and sends
    one request per call: ``prompt``, ``max_tokens``, ``temperature: 0`` and,
    when ``ignore_eos`` (vLLM and Parrot honour it), ``"ignore_eos": true``.
    A call is sent as soon as all its producers have answered, so independent
    calls (e.g. the map calls of a map-reduce) run concurrently, like
    LangChain's ``batch``; each request first pays one delay.  Requests are
    streamed; ``base_url`` is one server or a :class:`Router` over several.
    ``calls`` has a record per call: ``start_s`` (and ``ready_s``) when the
    request left (after its delay), ``first_token_s`` when its first text
    arrived, ``end_s`` when the stream ended, token counts from ``usage``.

    FastChat 0.2.36 (``fastchat/serve/openai_api_server.py``): its
    ``CompletionRequest`` has no ``ignore_eos`` field and pydantic drops
    unknown fields, so the flag would be silently ignored; its worker always
    stops at the tokenizer's EOS token and at the conversation template's stop
    string (``"###"`` for the ``one_shot`` template FastChat picks for a
    SmolLM2 folder).  Outputs there can be shorter than ``max_tokens``; the
    records carry what ``usage`` says, and FastChat's ``completion_tokens`` is
    its loop index, one less than the tokens generated when ``max_tokens`` is
    reached (50 asked, 50 generated, 49 reported).  Pass ``ignore_eos=False``.

    On the first failing call the app's other requests are cancelled.
    """
    await _sleep_until(t0, app.arrival_s)
    start = _rel(t0)
    record = AppRecord(app.app_id, app.kind, app.arrival_s, start, start)
    router = base_url if isinstance(base_url, Router) else Router([base_url])
    texts: dict[str, str] = {}
    records: dict[str, CallRecord] = {}
    tasks: dict[str, asyncio.Task[None]] = {}

    async def run_call(call: CallSpec) -> None:
        producers = {tasks[dep] for dep in call.deps.values()}
        if producers:
            await asyncio.gather(*producers)
        prompt = render_prompt(call, texts)
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": call.max_tokens,
            "temperature": 0.0,
        }
        if ignore_eos:
            body["ignore_eos"] = True
        await delay()
        with router.pick() as url:
            sent = _rel(t0)
            text, usage, first = await _complete(client, url, body, t0)
        texts[call.name] = text
        records[call.name] = CallRecord(
            call.name,
            sent,
            _rel(t0),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            engine=url if len(router.urls) > 1 else None,
            ready_s=sent,
            first_token_s=first,
        )

    try:
        for call in app.calls:  # topological order: producers' tasks exist already
            tasks[call.name] = asyncio.create_task(run_call(call), name=f"{app.app_id}/{call.name}")
        await asyncio.gather(*tasks.values())
        record.end_s = max((records[o].end_s for o in app.outputs), default=_rel(t0))
    except Exception as exc:
        record.end_s = _rel(t0)
        record.error = _describe(exc)
    finally:
        for task in tasks.values():
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)
    record.calls = [records[c.name] for c in app.calls if c.name in records]
    record.delays, record.delay_s = delay.count, delay.total_s
    return record


# ------------------------------------------------------------------ server metrics
def _prometheus_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample named in ``names`` (all label sets) in Prometheus text, read with
    prometheus_client's parser (a counter's samples are named with their ``_total``).
    Raises ValueError for text that is not the Prometheus format."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


_PARROT_COUNTERS = ("fills", "filled_tokens", "generates", "generated_tokens", "preemptions")
_PARROT_GAUGES = ("kv_tokens_used", "kv_blocks_used", "token_load", "latency_cap_tokens")
_VLLM_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)
_VLLM_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running")


async def _snapshot(client: httpx.AsyncClient, system: SystemHandle) -> dict[str, float] | None:
    """Counters and gauges of the system's engines now (summed over engines); None if unknown."""
    try:
        if system.backend == "parrot":
            response = await client.get(f"{system.base_url}/v1/engines", headers=system.operator_headers)
            response.raise_for_status()
            out: dict[str, float] = {}
            for engine in response.json():
                for key in _PARROT_COUNTERS + _PARROT_GAUGES:
                    out[key] = out.get(key, 0.0) + float(engine["stats"].get(key, 0))
            return out
        if system.backend == "vllm":  # summed over the servers
            total: dict[str, float] = {}
            for url in system.base_urls:
                response = await client.get(f"{url}/metrics")
                response.raise_for_status()
                for key, value in _prometheus_sums(response.text, _VLLM_COUNTERS + _VLLM_GAUGES).items():
                    total[key] = total.get(key, 0.0) + value
            return total
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return None


class _Sampler:
    """Polls the system's engine metrics during a run: peaks of gauges, deltas of counters."""

    def __init__(self, client: httpx.AsyncClient, system: SystemHandle):
        self.client, self.system = client, system
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] | None = None
        self.peaks: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def _take(self) -> None:
        snap = await _snapshot(self.client, self.system)
        if snap is None:
            return
        if self.first is None:
            self.first = snap
        self.last = snap
        for key, value in snap.items():
            self.peaks[key] = max(self.peaks.get(key, value), value)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(_SAMPLE_EVERY_S)
            await self._take()

    async def start(self) -> None:
        if self.system.backend in ("parrot", "vllm"):
            await self._take()
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is None:
            return {}
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._take()
        if self.first is None or self.last is None:
            return {}
        counters = _PARROT_COUNTERS if self.system.backend == "parrot" else _VLLM_COUNTERS
        return {
            "counters_delta": {k: self.last[k] - self.first.get(k, 0.0) for k in counters if k in self.last},
            "peaks": {k: v for k, v in self.peaks.items() if k not in counters},
            "sample_interval_s": _SAMPLE_EVERY_S,
        }


# ------------------------------------------------------------------ workload
def _new_client() -> httpx.AsyncClient:
    """An HTTP client for loopback servers: no proxies, no read timeout, many connections."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(30.0, read=None, pool=None),
        limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
        trust_env=False,
    )


async def _guarded(coro: Any, app: AppSpec, t0: float, timeout_s: float | None) -> AppRecord:
    """``coro`` (an app run) bounded by ``timeout_s``; a timeout becomes the app's error."""
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        record = AppRecord(app.app_id, app.kind, app.arrival_s, app.arrival_s, _rel(t0))
        record.error = f"TimeoutError: app not done after {timeout_s} s"
        return record


async def run_workload(
    system: SystemHandle,
    workload: Workload,
    *,
    repeat: int,
    delay_ms: tuple[float, float] = (200.0, 300.0),
    seed: int = 0,
    progress: Callable[[AppRecord], None] | None = None,
    app_timeout_s: float | None = DEFAULT_APP_TIMEOUT_S,
    isolated: bool = False,
) -> RunRecord:
    """Run every app of ``workload`` on ``system`` (each starting at its
    ``arrival_s``, all concurrently) and return the run's record.

    ``isolated``: the apps run one at a time instead, in arrival order, each as
    soon as the one before it ended; each app's clock is shifted so that its
    record keeps its own ``arrival_s`` and its latency (``end_s - arrival_s``) is
    its latency with nothing else on the system (the server's caches kept from
    the apps before it): for a load whose apps share no prompt, the least any
    scheduling could give it there.

    Systems of kind ``"parrot"`` get :func:`run_parrot_app`, kind ``"openai"``
    :func:`run_baseline_app`.  Each app draws its delays from its own
    :class:`Delay` seeded by ``(seed, workload.name, repeat, app_id)``, so an
    app sees the same delay sequence on every system.  ``progress`` is called
    with each app's record as it finishes.  ``wall_s`` spans from the workload
    start to the last app's end.  ``extra`` holds the system's description
    and, for Parrot and vLLM, engine metrics sampled during the run.
    """
    low, high = delay_ms

    def delay_for(app: AppSpec) -> Delay:
        return Delay(low, high, seed=f"{seed}/{workload.name}/{repeat}/{app.app_id}")

    router = Router(list(system.base_urls))
    async with _new_client() as client:
        sampler = _Sampler(client, system)
        await sampler.start()
        started_wall = time.time()
        t0 = time.perf_counter()

        async def one(app: AppSpec, t0: float) -> AppRecord:
            if system.kind == "parrot":
                coro = run_parrot_app(system.base_url, app, t0, delay_for(app))
            else:
                model, eos = system.model, system.ignore_eos
                coro = run_baseline_app(client, router, model, app, t0, delay_for(app), ignore_eos=eos)
            record = await _guarded(coro, app, t0, app_timeout_s)
            if progress is not None:
                progress(record)
            return record

        if isolated:
            apps = []
            for app in sorted(workload.apps, key=lambda a: a.arrival_s):
                apps.append(await one(app, time.perf_counter() - app.arrival_s))  # starts at once
            wall = time.perf_counter() - t0
        else:
            apps = await asyncio.gather(*(one(app, t0) for app in workload.apps))
            wall = max((a.end_s for a in apps), default=time.perf_counter() - t0)
        metrics = await sampler.stop()
    extra: dict[str, Any] = {
        "started_at": started_wall,
        "system": system.describe(),
        "engines_requested": workload.engines,
        "delay_ms": [low, high],
        "seed": seed,
    }
    if isolated:
        extra["isolated"] = True
    if metrics:
        extra["engine_metrics"] = metrics
    if len(router.urls) > 1:
        extra["requests_per_server"] = dict(zip(router.urls, router.sent, strict=True))
    return RunRecord(
        system=system.name,
        workload=workload.name,
        figure=workload.figure,
        params=dict(workload.params),
        repeat=repeat,
        wall_s=wall,
        apps=list(apps),
        extra=extra,
    )
