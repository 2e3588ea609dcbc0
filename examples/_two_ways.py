"""Run one example application two ways on the same server, and compare them.

Not an example itself; the example apps import it.

**Parrot** (semantic functions): every call of the application is recorded in
one ``session.batch()`` and submitted as one request, which also creates the
session (``P.aconnect(url, defer_open=True)``); dependencies are variables
wired on the server, which runs each call as soon as its inputs exist; only
the application's final value is fetched.  That is two HTTP requests, however
many calls the application makes (a long poll that outlasts the server's
30 s ``wait`` adds one more ``GET``).  Closing the session comes after the
clock stops and pays no delay, as closing the request-level client's
connections does.

**Request level**: what a client of a completion API does.  For each call it
renders the prompt itself (:meth:`parrot.SemanticFunction.render`: exactly
the text the server renders for the same call, chat markup included), sends
one ``POST /v1/completions``, and applies the output's transform to the
answer.  A call is sent once the answers it depends on are back; calls that
do not depend on each other are sent concurrently (as a well-written client
would), so the comparison is with the best a request-level client can do.

**Emulated network**: each HTTP request of either way costs one round trip of
``delay_ms``: half is slept before the request leaves, half after its answer
arrived.

**Same engine state**: before either way is timed, the model's chat markup is
read (``GET /v1/models``) and the application runs once, untimed and with no
delay (the request-level way).  The engine's prefix cache keeps computed
prompt blocks, and both ways send it the same prompts, so without this the
way timed second would find the first one's prompts already computed; after
it, both find every prompt of the application cached (and the engine's
first-use costs paid).

The application is written once, as a function of its semantic functions;
:func:`compare` runs it with the real semantic functions inside a Parrot
session, then with their request-level stand-ins, and reports both wall
times, their ratio, the requests each way sent, and whether the final values
are equal (greedy decoding makes them comparable).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

import parrot as P
from parrot.protocol.errors import error_from_body
from parrot.protocol.tokenizer import ChatFormat

DEFAULT_DELAY_MS = 250.0
REQUEST_TIMEOUT_S = 600.0  # one completion may take long on a slow CPU
_CONTEXT_CHARS = 30  # characters shown either side of a difference


# ------------------------------------------------------------------ network
class Network(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An HTTP transport (sync and async) that delays every request by one
    emulated round trip (``rtt_s``: half before sending, half after the whole
    answer arrived) and logs ``(method, path)`` of each.  While ``charging`` is
    false, requests pass undelayed and unlogged.  Thread-safe."""

    def __init__(self, rtt_s: float, *, charging: bool = True):
        if rtt_s < 0:
            raise ValueError("the round trip cannot be negative")
        self.rtt_s = rtt_s
        self.charging = charging
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._sync = httpx.HTTPTransport()
        self._async = httpx.AsyncHTTPTransport()

    def _charge(self, request: httpx.Request) -> bool:
        if self.charging:
            with self._lock:
                self.log.append((request.method, request.url.path))
        return self.charging

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self._charge(request):
            return self._sync.handle_request(request)
        time.sleep(self.rtt_s / 2)
        response = self._sync.handle_request(request)
        try:
            response.read()  # the answer is in before its trip back is charged
        except BaseException:
            response.close()
            raise
        time.sleep(self.rtt_s / 2)
        return response

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._charge(request):
            return await self._async.handle_async_request(request)
        await asyncio.sleep(self.rtt_s / 2)
        response = await self._async.handle_async_request(request)
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        await asyncio.sleep(self.rtt_s / 2)
        return response

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        await self._async.aclose()


def describe_requests(log: list[tuple[str, str]]) -> str:
    """``2 (submit 1, get 1)``: the count, then by kind in first-seen order."""
    kinds = Counter(_kind(method, path) for method, path in log)
    return f"{len(log)} ({', '.join(f'{k} {n}' for k, n in kinds.items())})"


def _kind(method: str, path: str) -> str:
    if path == "/v1/completions":
        return "completion"
    if method == "POST" and (path == "/v1/sessions" or path.endswith("/batch") or path.endswith("/calls")):
        return "submit"  # POST /v1/sessions carries the first batch (defer_open)
    if method == "DELETE":
        return "close session"
    if method == "GET" and "/variables/" in path:
        return "get"
    return f"{method} {path}"


# ------------------------------------------------------------ request level
class Answer:
    """The request-level stand-in for a semantic variable: a future of one answer's text."""

    def __init__(self, future: Future[str]):
        self._future = future

    def get(self, criteria: str | None = None, timeout: float | None = None) -> str:
        return self._future.result(timeout)


class RequestLevelClient:
    """A completion-API client: one ``POST /v1/completions`` per call, prompt rendered here.

    :meth:`function` wraps a semantic function: calling the wrapper starts the
    call in a worker thread, which waits for the answers among its inputs,
    renders the prompt, sends it, and applies the output's transform.  Calls
    are started in program order and a call only waits for earlier ones, so
    the FIFO pool cannot deadlock.
    """

    def __init__(
        self, url: str, transport: httpx.BaseTransport, chat_format: ChatFormat | None, max_workers: int = 64
    ):
        self.chat_format = chat_format
        self._http = httpx.Client(base_url=url, transport=transport, timeout=REQUEST_TIMEOUT_S)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="request-level")

    def __enter__(self) -> RequestLevelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def function(self, fn: P.SemanticFunction) -> Callable[..., Answer]:
        if len(fn.outputs) != 1:
            raise ValueError(f"{fn.__name__}: a request-level call generates one output")

        def call(*args: Any, **kwargs: Any) -> Answer:
            inputs = fn.bind(args, kwargs)
            return Answer(self._pool.submit(self._run, fn, inputs))

        return call

    def _run(self, fn: P.SemanticFunction, inputs: dict[str, Any]) -> str:
        values = {k: v.get() if isinstance(v, Answer) else v for k, v in inputs.items()}
        prompt = fn.render(values, self.chat_format)
        (output,) = fn.outputs.values()
        body = {"prompt": prompt, "model": fn.model, **output.sampling.to_dict()}
        response = self._http.post("/v1/completions", json=body)
        if not response.is_success:
            raise error_from_body(response.status_code, response.json())
        text = response.json()["choices"][0]["text"]
        return text if output.transform is None else output.transform.apply(text)


def chat_format_of(url: str, model: str | None = None) -> ChatFormat | None:
    """The served model's chat markup, from ``GET /v1/models`` (the first model if ``model`` is None)."""
    response = httpx.get(f"{url}/v1/models", timeout=30.0)
    response.raise_for_status()
    models = response.json()["data"]
    entry = next((m for m in models if model is None or m["id"] == model), None)
    if entry is None:
        raise LookupError(f"the server does not serve {model!r}")
    fmt = entry.get("chat_format")
    return None if fmt is None else ChatFormat(**fmt)


# ------------------------------------------------------------------ running
Way = Callable[[P.SemanticFunction], Callable[..., Any]]
"""How an application reaches a semantic function: the function itself (Parrot),
or its request-level stand-in."""

App = Callable[[Way], Any]
"""An application: given a way, it makes its calls and returns its final
value's handle (anything with ``.get()``)."""


@dataclass
class WayResult:
    value: str
    seconds: float
    requests: list[tuple[str, str]]


@dataclass
class Comparison:
    parrot: WayResult
    request_level: WayResult
    delay_ms: float

    @property
    def equal(self) -> bool:
        return self.parrot.value == self.request_level.value

    @property
    def ratio(self) -> float:
        """Request-level time over Parrot's: above 1, Parrot was faster."""
        return self.request_level.seconds / self.parrot.seconds


def run_parrot(app: App, url: str, delay_ms: float) -> WayResult:
    return asyncio.run(_run_parrot(app, url, delay_ms))


async def _run_parrot(app: App, url: str, delay_ms: float) -> WayResult:
    network = Network(delay_ms / 1000.0)
    try:
        # defer_open: the manager session is created by the request carrying the batch
        async with P.aconnect(url, timeout=REQUEST_TIMEOUT_S, transport=network, defer_open=True) as session:
            start = time.perf_counter()
            async with session.batch():  # every call of the app, in one request
                final = app(lambda fn: fn)
            value = await final.aget(P.LATENCY)  # the only value that travels back
            seconds = time.perf_counter() - start
            network.charging = False  # closing the session is after the app, like closing a connection
    finally:
        await network.aclose()
    return WayResult(value, seconds, list(network.log))


def run_request_level(app: App, url: str, delay_ms: float, chat_format: ChatFormat | None) -> WayResult:
    network = Network(delay_ms / 1000.0)
    try:
        with RequestLevelClient(url, network, chat_format) as client:
            start = time.perf_counter()
            value = app(client.function).get()
            seconds = time.perf_counter() - start
    finally:
        network.close()
    return WayResult(value, seconds, list(network.log))


def compare(app: App, url: str, delay_ms: float = DEFAULT_DELAY_MS) -> Comparison:
    """Run ``app`` the Parrot way, then the request-level way, on the server at ``url``."""
    chat_format = chat_format_of(url)
    run_request_level(app, url, 0.0, chat_format)  # warm-up: see "Same engine state" above
    parrot = run_parrot(app, url, delay_ms)
    request_level = run_request_level(app, url, delay_ms, chat_format)
    return Comparison(parrot, request_level, delay_ms)


# ------------------------------------------------------------------ reporting
def first_difference(a: str, b: str) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter's length if one
    is a prefix of the other); None if they are equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def equality_line(a: str, b: str) -> str:
    """``outputs equal: yes``, or ``no`` with where and how the two first differ."""
    at = first_difference(a, b)
    if at is None:
        return "outputs equal: yes"
    lo = max(0, at - _CONTEXT_CHARS)

    def around(s: str) -> str:
        return repr(("..." if lo else "") + s[lo : at + _CONTEXT_CHARS])

    return (
        f"outputs equal: no (first difference at character {at} of {len(a)} / {len(b)}: "
        f"Parrot {around(a)} vs request level {around(b)})"
    )


def report(c: Comparison) -> str:
    """The comparison as printed by the examples."""
    p, r = c.parrot, c.request_level
    width = 32
    return "\n".join(
        [
            f"emulated network: {c.delay_ms:g} ms round trip per HTTP request, both ways; "
            "both timed after an untimed run of the app (same engine and prefix-cache state)",
            f"{'Parrot (semantic functions):':<{width}} {p.seconds:6.2f} s, "
            f"requests {describe_requests(p.requests)}",
            f"{'request level (/v1/completions):':<{width}} {r.seconds:6.2f} s, "
            f"requests {describe_requests(r.requests)}",
            f"request level / Parrot: {c.ratio:.2f}x",
            equality_line(p.value, r.value),
        ]
    )
