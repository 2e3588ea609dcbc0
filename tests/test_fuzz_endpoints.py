"""Fuzz every HTTP endpoint of the manager and of an engine process: no request gets a 5xx
(nor a response that breaks off half-way, nor an exception logged by the server), and
``/healthz`` answers within a second throughout.

The routes come from each app's OpenAPI schema (and its other routes, such as ``/docs``),
so a new endpoint is fuzzed without touching this file.  Each drawn request is valid but
for one fault (:data:`FAULTS`), so that every fault gets as deep into the server as it
can: a path parameter that does not exist (unicode, very long, a lone surrogate), query
parameters out of range or unknown, the ``Authorization`` or ``X-Parrot-Cluster-Secret``
header missing, garbage or one character off, odd content types and encodings, or the
body: a valid one (built for the route, or from its schema) with one field replaced,
removed or added; arbitrary JSON (nested, huge numbers, ``NaN``, ``1e308``, lone
surrogates sent as ``\\ud800`` escapes, wrong types, nesting deeper than Python's
recursion limit); or bytes that are not JSON at all (truncated, invalid UTF-8, another
content type).  Valid requests name things that exist (a session with its token, its
variables and a call; both engines; a filled engine context) and ask for a few tokens, so
generation stays cheap.  Strings in bodies have at most 5,000 characters: this file looks
for wrong answers, not for the cost of big inputs.

Real servers on loopback: the manager (the tiny engine embedded, a cluster secret, and an
engine process's app registered as a remote engine, whose heartbeats the fuzzer sends)
and that engine process's app, guarded by the same secret.  A separate process times
``/healthz`` on each while the fuzzer runs.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from parrot.engine.http_app import create_engine_app
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.manager.api.app import create_app
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.asgi import install_error_handlers, startup_objects_frozen
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER
from parrot.protocol.schemas import EngineStats, StrictBody
from tests.conftest import LiveServer, serve_asgi
from tests.procs import OPERATOR, TEST_CLUSTER_SECRET, free_port

EXAMPLES_PER_ROUTE = int(os.environ.get("PARROT_FUZZ_EXAMPLES", "60"))
"""Requests hypothesis draws per route: sized so the file runs in well under 90 s on 2 cores
(set ``PARROT_FUZZ_EXAMPLES``, and ``PARROT_FUZZ_SEED`` for other requests, to fuzz longer)."""
FUZZ_SEED = os.environ.get("PARROT_FUZZ_SEED")
HEALTHZ_LIMIT_S = 1.0
REQUEST_TIMEOUT_S = 20.0
"""A request not answered in this long is a stall (the longest valid body generates a few tokens)."""
STREAM_READ_S = 2.0
"""How long a streaming answer is read; one still open then (a long-poll) is left open."""

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    derandomize=FUZZ_SEED is None,  # by default the same requests on every run: CI stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


# ------------------------------------------------------------------ routes
@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "path", "query" or "header"
    schema: dict[str, Any]


@dataclass(frozen=True)
class Route:
    """One operation of an OpenAPI schema, with its request body's schema resolved."""

    method: str
    path: str
    params: tuple[Param, ...]
    body: dict[str, Any] | None  # the JSON schema of the body, None: takes none

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


def resolve(schema: Any, components: dict[str, Any], seen: frozenset[str] = frozenset()) -> Any:
    """``schema`` with every ``$ref`` inlined (a recursive reference becomes ``{}``: anything)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            if name in seen:
                return {}
            return resolve(components[name], components, seen | {name})
        return {k: resolve(v, components, seen) for k, v in schema.items()}
    if isinstance(schema, list):
        return [resolve(v, components, seen) for v in schema]
    return schema


def routes_of(app: FastAPI) -> list[Route]:
    """Every operation of ``app``'s OpenAPI schema, then its routes outside the schema
    (the schema itself, the docs pages) with neither parameters nor body."""
    openapi = app.openapi()
    components = openapi.get("components", {}).get("schemas", {})
    routes = []
    for path, operations in openapi["paths"].items():
        for method, op in operations.items():
            params = tuple(
                Param(p["name"], p["in"], resolve(p.get("schema", {}), components))
                for p in op.get("parameters", [])
            )
            content = op.get("requestBody", {}).get("content", {})
            body = content.get("application/json", {}).get("schema")
            routes.append(
                Route(method.upper(), path, params, None if body is None else resolve(body, components))
            )
    known = {r.key for r in routes}
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            extra = Route(method, getattr(route, "path", ""), (), None)
            if extra.path and extra.key not in known and method != "HEAD":
                routes.append(extra)
                known.add(extra.key)
    return routes


def example(schema: dict[str, Any]) -> Any:
    """A value that fits ``schema``, every property set (to its default where it has one),
    for a route this file has no valid body of its own for."""
    if "default" in schema:
        return schema["default"]
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [s for s in schema[key] if s.get("type") != "null"] or schema[key]
            return example(options[0])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {name: example(sub) for name, sub in props.items()}
    if kind == "array":
        return []
    return {"string": "x", "integer": 1, "number": 1.0, "boolean": False, "null": None}.get(kind, {})


# -------------------------------------------------------------------- JSON
@dataclass(frozen=True)
class RawJSON:
    """JSON text sent as is (what ``json.dumps`` cannot write: a 5,000-digit number,
    nesting deeper than Python's recursion limit)."""

    text: str


def dumps(value: Any) -> str:
    """``value`` as JSON text: non-ASCII escaped (a lone surrogate goes as ``\\ud800``),
    ``NaN`` and ``Infinity`` as Python writes them, :class:`RawJSON` verbatim."""
    if isinstance(value, RawJSON):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


ODD_TEXT = [
    "",
    "\ud800",
    "a\udfffb",
    "\x00",
    "\U0001f99c",
    "{{output:x}}",
    "{{input:",
    "}}{{",
    "Bearer",
    "null",
    "-1",
    "NaN",
    "../../etc/passwd",
    "%00",
    "tiny",
]
texts = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(exclude_categories=()), max_size=20),  # surrogates included
    st.sampled_from(ODD_TEXT),
    st.integers(200, 5000).map(lambda n: "x" * n),
)
ints = st.one_of(
    st.integers(-10, 10),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**40]),
    st.integers(-(2**70), 2**70),
    st.just(RawJSON("1" + "0" * 5000)),  # over Python's int-parsing limit
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 1e308, -1e308, 5e-324, float("nan"), float("inf"), -0.0]),
    st.just(RawJSON("1e999999")),  # infinity, written as a number
)
numbers = st.one_of(ints, floats)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(texts, inner, max_size=5),
    ),
    max_leaves=12,
)
deep = st.integers(50, 200_000).map(lambda n: RawJSON("[" * n + "]" * n))


def field_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``value`` a mutation can hit (dict keys and list indices, any depth)."""
    paths = []
    if isinstance(value, dict):
        for k, v in value.items():
            paths.append((*prefix, k))
            paths.extend(field_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            paths.append((*prefix, i))
            paths.extend(field_paths(v, (*prefix, i)))
    return paths


def property_names(schema: Any) -> set[str]:
    """Every property name declared anywhere in ``schema``."""
    names: set[str] = set()
    if isinstance(schema, dict):
        names.update(schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else ())
        for value in schema.values():
            names |= property_names(value)
    elif isinstance(schema, list):
        for value in schema:
            names |= property_names(value)
    return names


def like(value: Any) -> st.SearchStrategy[Any]:
    """Values of ``value``'s JSON type, odd ones first: what a schema lets through and the
    code behind it must still handle (an id of 2**63, an empty list, a lone surrogate)."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return ints
    if isinstance(value, float):
        return floats
    if isinstance(value, str):
        return texts
    if isinstance(value, list):
        more = st.lists(like(value[0]), min_size=2, max_size=70) if value else st.nothing()
        return st.one_of(st.just([]), more, st.lists(json_values, max_size=3))
    if isinstance(value, dict):
        return st.just({})
    return json_values


def mutated(body: Any, schema: dict[str, Any] | None, data: st.DataObject) -> Any:
    """``body`` (a deep copy) with one field replaced (by a value of its type, mostly, or
    anything), removed, or one added (a name the schema declares somewhere, or any)."""
    body = copy.deepcopy(body)
    paths = field_paths(body)
    how = data.draw(st.sampled_from(["replace", "replace", "remove", "add"] if paths else ["add"]))
    if how == "add" or not paths:
        containers = [()] + [p for p in paths if isinstance(_get(body, p), dict)]
        where = data.draw(st.sampled_from(containers))
        target = _get(body, where)
        if isinstance(target, dict):
            names = sorted(property_names(schema))
            key = data.draw(st.one_of(st.sampled_from(names), texts) if names else texts)
            target[key] = data.draw(json_values)
            return body
        return data.draw(json_values)
    path = data.draw(st.sampled_from(paths))
    parent = _get(body, path[:-1])
    if how == "remove":
        del parent[path[-1]]
    else:
        current = parent[path[-1]]
        parent[path[-1]] = data.draw(st.one_of(like(current), like(current), json_values))
    return body


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


# ----------------------------------------------------------------- targets
@dataclass
class Target:
    """A live server, its routes, and what a request to it can name that exists."""

    name: str
    live: LiveServer
    routes: list[Route]
    ids: dict[str, list[str]]  # path parameter -> values that exist
    valid_bodies: Callable[[Route, st.DataObject], Any]
    auth_values: list[str] = field(default_factory=list)
    covered: set[str] = field(default_factory=set)
    after: Callable[[Route, int], None] = lambda route, status: None
    """Called with each answer's status: recreates what a request may have deleted."""


FAULTS = ("none", "path", "auth", "query", "headers", "body", "body", "body", "body")
"""What a drawn request gets wrong, if anything; the rest of it is valid, so that each
fault reaches as deep into the server as it can.  Bodies are where most can go wrong."""


def valid_header(target: Target, param: Param) -> bytes | None:
    """The credential a valid request presents in header ``param``."""
    if param.name == "Authorization" and target.auth_values:
        return f"Bearer {target.auth_values[0]}".encode()
    if param.name == CLUSTER_SECRET_HEADER:
        return TEST_CLUSTER_SECRET.encode()
    return None


def bad_headers(target: Target, param: Param) -> st.SearchStrategy[bytes | None]:
    """Missing, garbage, or close to valid (another scheme, one character off)."""
    garbage = st.binary(max_size=60).map(  # no control characters, no surrounding blanks: valid HTTP
        lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip(b" ")
    )
    near: list[str] = ["Bearer", "Basic dXNlcjpwYXNz", "Bearer " + "x" * 5000, "x" * 9000]
    if param.name == "Authorization":
        near += [f"bearer {t}" for t in target.auth_values] + [f"Bearer {t}x" for t in target.auth_values]
    elif param.name == CLUSTER_SECRET_HEADER:
        near += [TEST_CLUSTER_SECRET + "x", TEST_CLUSTER_SECRET[:-1], TEST_CLUSTER_SECRET.upper()]
    return st.one_of(st.none(), st.sampled_from([v.encode() for v in near]), garbage)


@dataclass
class Request:
    method: str
    url: str
    headers: dict[str, bytes]
    content: bytes | None

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        body = None if self.content is None else self.content[:600]
        return f"{self.method} {self.url[:300]} headers={self.headers!r:.300} body={body!r}"


def draw_request(target: Target, route: Route, data: st.DataObject) -> Request:
    """A request to ``route`` that is valid but for one drawn fault (see :data:`FAULTS`)."""
    fault = data.draw(st.sampled_from(FAULTS), label="fault")
    path = route.path
    params: list[tuple[str, str]] = []
    headers: dict[str, bytes] = {}
    path_params = [p.name for p in route.params if p.where == "path"]
    broken = None  # the path parameter that names nothing
    if fault == "path" and path_params:
        broken = data.draw(st.sampled_from(path_params), label="broken")
    for p in route.params:
        if p.where == "path":
            existing = target.ids.get(p.name, [])
            if p.name == broken or not existing:
                value = data.draw(st.one_of(texts, st.text(min_size=1, max_size=12)), label=p.name)
            else:
                value = data.draw(st.sampled_from(existing), label=p.name)
            path = path.replace("{" + p.name + "}", _quote(value))
        elif p.where == "query":
            value = data.draw(query_value(p, valid=fault != "query"), label=p.name)
            if value is not None:
                params.append((p.name, value))
        elif p.where == "header":
            value = valid_header(target, p)
            if fault == "auth":
                value = data.draw(bad_headers(target, p), label=p.name)
            if value is not None:
                headers[p.name] = value
    if fault == "query":
        params += data.draw(st.lists(st.tuples(texts, texts), min_size=1, max_size=2), label="extra query")
    if fault == "headers":
        headers.update(data.draw(odd_headers(), label="headers"))
    content: bytes | None = None
    content_type = b"application/json"
    kind = "none" if route.body is None else "valid"
    if fault == "body":
        kind = data.draw(st.sampled_from(["mutated", "mutated", "json", "raw", "none"]), label="body")
    if kind == "valid":
        content = dumps(target.valid_bodies(route, data)).encode()
    elif kind == "mutated":
        valid = target.valid_bodies(route, data) if route.body is not None else {}
        content = dumps(mutated(valid, route.body, data)).encode()
    elif kind == "json":
        content = dumps(data.draw(st.one_of(json_values, deep), label="json")).encode()
    elif kind == "raw":
        valid = dumps(target.valid_bodies(route, data) if route.body is not None else {"a": [1, 2]})
        content, content_type = data.draw(raw_bodies(valid), label="raw")
    if content is not None and "content-type" not in {k.lower() for k in headers}:
        headers["Content-Type"] = content_type
    query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in params)
    return Request(route.method, target.live.url + path + (f"?{query}" if query else ""), headers, content)


def _quote(text: str) -> str:
    """``text`` percent-encoded as UTF-8, a lone surrogate included (as the invalid bytes
    UTF-8 would give it: the server must cope with them)."""
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


def query_value(param: Param, *, valid: bool) -> st.SearchStrategy[str | None]:
    """A value for query parameter ``param``: absent or fitting its schema when ``valid``
    (numbers small: a long-poll on a pending variable waits that long), else anything."""
    schemas = [param.schema, *param.schema.get("anyOf", [])]
    enum = next((s["enum"] for s in schemas if "enum" in s), None)
    numeric = any(s.get("type") in ("number", "integer") for s in schemas)
    if valid:
        options: list[st.SearchStrategy[str | None]] = [st.none()]
        if enum:
            options.append(st.sampled_from([str(e) for e in enum]))
        if numeric:
            options.append(st.sampled_from(["0", "0.05", "0.2"]))
        return st.one_of(options)
    odd = ["-1", "61", "1e308", "nan", "inf", "-0", "0x10", "1_0", "true", ""]
    return st.one_of(texts, st.sampled_from(odd), st.floats().map(str))


def odd_headers() -> st.SearchStrategy[dict[str, bytes]]:
    """A header that changes how a body is read: a wrong content type or encoding."""
    return st.dictionaries(
        st.sampled_from(["Content-Type", "Content-Encoding", "Accept", "Expect", "Transfer-Encoding-X"]),
        st.sampled_from(
            [b"text/plain", b"gzip", b"*/*", b"\xff\xfe", b"multipart/form-data; boundary=x", b"100-continue"]
        ),
        min_size=1,
        max_size=2,
    )


def raw_bodies(valid_json: str) -> st.SearchStrategy[tuple[bytes, bytes]]:
    """(body, content type): a valid body cut short, not JSON, not UTF-8, or the wrong type."""
    data = valid_json.encode()
    return st.one_of(
        st.integers(0, max(len(data) - 1, 0)).map(lambda n: (data[:n], b"application/json")),
        st.binary(max_size=200).map(lambda b: (b, b"application/json")),
        st.sampled_from([b"\xff\xfe{}", b"{'a': 1}", b"{,}", b"[", b"nul", b"{}{}", b'{"a":1,"a":2}']).map(
            lambda b: (b, b"application/json")
        ),
        st.just((data, b"text/plain")),
        st.just((b"a=1&b=2", b"application/x-www-form-urlencoded")),
        st.just((data, b"application/json; charset=latin-1")),
    )


# --------------------------------------------------------------- checking
class ErrorLog(logging.Handler):
    """Keeps ERROR records: an exception escaping a request (uvicorn's and the apps' own
    handlers log it), a scheduling round or a call failing on a bug, a task nobody awaited."""

    WATCHED = ("uvicorn.error", "parrot", "asyncio")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def describe(self) -> str:
        return "\n".join(self.format(r) for r in self.records[:3])


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in ErrorLog.WATCHED]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


PROBE_SCRIPT = """
import http.client, json, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
slowest, answers, failures = 0.0, 0, []
conn = http.client.HTTPConnection(host, port, timeout=30)
while not stop.is_set():
    started = time.monotonic()
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        status = resp.status
    except Exception as exc:
        failures.append(repr(exc))
        conn.close()
        conn = http.client.HTTPConnection(host, port, timeout=30)
        status = 0
    slowest = max(slowest, time.monotonic() - started)
    answers += 1
    if status != 200:
        failures.append(f"/healthz answered {status}")
    stop.wait(0.02)
print(json.dumps({"slowest": slowest, "answers": answers, "failures": failures[:5]}))
"""


class HealthProbe:
    """Times ``GET /healthz`` on a server, back to back, from a process of its own: a
    thread of this one would stop timing while a server thread holds the GIL, and miss
    exactly the stalls it is there to see."""

    def __init__(self, url: str):
        host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
        self._args = [sys.executable, "-c", PROBE_SCRIPT, str(host), str(port)]
        self._proc: subprocess.Popen[bytes] | None = None
        self.slowest = 0.0
        self.answers = 0
        self.failures: list[str] = []

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen(self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    def __exit__(self, *_: Any) -> None:
        assert self._proc is not None
        try:
            out, _ = self._proc.communicate(b"", timeout=60)  # end of input: the prober stops
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(timeout=10)
        result = json.loads(out)
        self.slowest, self.answers, self.failures = result["slowest"], result["answers"], result["failures"]


def allowed_5xx(status: int, answer: bytes, request: Request) -> bool:
    """The one 5xx a valid request may get: 503 ``no_engine`` for a model no engine serves
    (the documented answer of ``/v1/completions``, OpenAI's and vLLM's status differ)."""
    if status != 503 or request.content is None:
        return False
    try:
        code = json.loads(answer)["error"]["code"]
        model = json.loads(request.content).get("model")
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return code == "no_engine" and model is not None and model != "tiny"


def send(http: httpx.Client, request: Request) -> tuple[int, bytes]:
    """The status and (the first seconds of) the body; a broken response raises."""
    with http.stream(
        request.method,
        request.url,
        headers=request.headers,
        content=request.content,
    ) as resp:
        streaming = resp.headers.get("content-type", "").startswith(
            ("application/x-ndjson", "text/event-stream")
        )
        if not streaming:
            return resp.status_code, resp.read()
        # read the body with a short timeout (a long-poll may send nothing for a while): httpcore
        # takes it from the request's extensions when the body is first read, not before
        resp.request.extensions["timeout"]["read"] = STREAM_READ_S
        got = bytearray()
        deadline = time.monotonic() + STREAM_READ_S
        try:
            for chunk in resp.iter_bytes():
                got.extend(chunk)
                if time.monotonic() > deadline:
                    break
        except httpx.ReadTimeout:
            pass  # a long-poll still open: fine, it is closed here
        return resp.status_code, bytes(got)


def fuzz_route(target: Target, route: Route, http: httpx.Client, error_log: ErrorLog) -> None:
    """Send :data:`EXAMPLES_PER_ROUTE` drawn requests to ``route``; none gets a 5xx."""

    @FUZZ_SETTINGS
    @given(data=st.data())
    def one_request(data: st.DataObject) -> None:
        request = draw_request(target, route, data)
        error_log.records.clear()  # (what an earlier request left failed that one already)
        started = time.monotonic()
        try:
            status, answer = send(http, request)
        except httpx.TimeoutException as exc:
            raise AssertionError(f"no answer in {time.monotonic() - started:.1f} s: {exc!r}") from exc
        except httpx.TransportError as exc:  # e.g. a stream that broke off after its 200
            raise AssertionError(f"the server broke the connection: {exc!r}") from exc
        target.covered.add(route.key)
        assert status < 500 or allowed_5xx(status, answer, request), (
            f"{status} {answer[:2000]!r} for {request}"
        )
        assert not error_log.records, f"{error_log.describe()}\nafter {request}"
        target.after(route, status)

    if FUZZ_SEED is not None:
        one_request = seed(int(FUZZ_SEED))(one_request)
    one_request()


def fuzz(target: Target, error_log: ErrorLog) -> None:
    """Fuzz every route of ``target``; meanwhile /healthz answers every time, and fast
    (the test process's heap frozen out of the collector, as a served process's is)."""
    # a connection per request: one a request broke cannot fail the next
    fresh = httpx.Limits(max_keepalive_connections=0)
    with (
        startup_objects_frozen(),
        HealthProbe(target.live.url) as probe,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=fresh) as http,
    ):
        for route in target.routes:
            fuzz_route(target, route, http, error_log)
    assert probe.answers > 0 and not probe.failures, probe.failures[:5]
    assert probe.slowest < HEALTHZ_LIMIT_S, f"/healthz took {probe.slowest:.2f} s"


# ---------------------------------------------------------------- manager
@dataclass
class ManagerIds:
    """A session of the manager with a variable holding a value, one pending, and a call."""

    session_id: str = ""
    token: str = ""
    ready_var: str = ""
    pending_var: str = ""
    call_id: str = ""
    output_var: str = ""

    def create(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            created = http.post("/v1/sessions").json()
            self.session_id, self.token = created["session_id"], created["token"]
            auth = {"Authorization": f"Bearer {self.token}"}
            path = f"/v1/sessions/{self.session_id}"
            ready = http.post(f"{path}/variables", json={"value": "hello"}, headers=auth)
            pending = http.post(f"{path}/variables", json={}, headers=auth)
            self.ready_var, self.pending_var = ready.json()["var_id"], pending.json()["var_id"]
            call = http.post(f"{path}/calls", json=call_body(self.ready_var), headers=auth).json()
            self.call_id, self.output_var = call["call_id"], call["outputs"]["b"]

    def path_ids(self) -> dict[str, list[str]]:
        return {
            "session_id": [self.session_id],
            "var_id": [self.ready_var, self.pending_var, self.output_var],
            "call_id": [self.call_id],
        }


def call_body(input_var: str, output_var: str | None = None, *, full: bool = False) -> dict[str, Any]:
    """A valid call of ``input_var`` generating two tokens (``full``: every optional field set)."""
    out: dict[str, Any] = {"name": "b", "direction": "output", "sampling": {"max_tokens": 2}}
    if output_var is not None:
        out["var_id"] = output_var
    body: dict[str, Any] = {
        "template": "Say {{input:a}} {{output:b}}",
        "placeholders": [{"name": "a", "direction": "input", "var_id": input_var}, out],
    }
    if full:
        out["sampling"] = {
            "max_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 1,
            "stop": ["\n"],
            "stop_token_ids": [0],
            "ignore_eos": True,
        }
        out["transform"] = [{"kind": "strip"}, {"kind": "regex", "pattern": "(.*)", "group": 1}]
        out["criteria"] = "LATENCY"
        body.update(name="fuzz.call", model="tiny", chat=True)
    return body


def batch_body() -> dict[str, Any]:
    """A valid batch: a variable, a call reading it, a variable set later in the batch."""
    call = call_body("")
    call["placeholders"][0] = {"name": "a", "direction": "input", "ref": "v"}
    return {
        "ops": [
            {"op": "create_variable", "ref": "v", "value": "hi"},
            {"op": "submit_call", **call},
            {"op": "create_variable", "ref": "w"},
            {"op": "set_variable", "ref": "w", "value": "later"},
        ]
    }


COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "hi", "max_tokens": 2},
    {"prompt": ["hi"], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "seed": 3,
        "stop": ["x"],
        "n": 1,
        "best_of": 1,
        "ignore_eos": True,
        "stop_token_ids": [1],
        "echo": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "user": "fuzz",
    },
]
"""Valid completions, the last with every field OpenAI's API and vLLM's extensions allow."""


HEARTBEAT_STATS = EngineStats(
    token_capacity=8192,
    kv_tokens_total=262144,
    kv_blocks_total=16384,
    kv_block_size=16,
    latency_cap_tokens=2048,
    latency_cap_source="measured",
    decode_ms_base=2.0,
    decode_ms_per_1k_tokens=0.5,
    decode_ms_target=5.0,
    decode_steps_fitted=10,
    prefill_tokens_per_decode_step=30.0,
).model_dump()
"""A remote engine's plausible heartbeat, every field set (for the mutations to hit)."""


@pytest.fixture(scope="module")
def manager_target(tiny_engine: LocalEngine, engine_target: Target) -> Iterator[Target]:
    """The manager, with the tiny engine embedded and :func:`engine_target`'s engine
    registered as a remote one (never dropped: the fuzzer sends its heartbeats)."""
    manager = Manager(ManagerConfig(cluster_secret=TEST_CLUSTER_SECRET, heartbeat_timeout_s=3600))
    handle = manager.pool.register(tiny_engine, name="tiny")
    app = create_app(manager)
    live = serve_asgi(app, LiveServer(url="", manager=manager), nodelay=True)
    remote = httpx.post(
        f"{live.url}/v1/engines",
        json={"url": engine_target.live.url, "model": "tiny", "max_seq_len": 2048, "name": "remote"},
        headers=OPERATOR,
        timeout=30,
    )
    assert remote.status_code == 201, remote.text
    ids = ManagerIds()
    ids.create(live.url)
    closed_port = free_port()

    def valid(route: Route, data: st.DataObject) -> Any:
        bodies: dict[str, list[Any]] = {
            "POST /v1/sessions": [{}, {"batch": batch_body()}],
            "POST /v1/sessions/{session_id}/variables": [{"name": "n", "value": "v"}, {}],
            "PUT /v1/sessions/{session_id}/variables/{var_id}": [{"value": "v"}],
            "POST /v1/sessions/{session_id}/calls": [
                call_body(ids.ready_var),
                call_body(ids.ready_var, full=True),
                call_body(ids.ready_var, ids.pending_var),
                call_body(ids.output_var),
            ],
            "POST /v1/sessions/{session_id}/batch": [batch_body(), {"ops": []}],
            "POST /v1/engines": [
                {"url": f"http://127.0.0.1:{closed_port}", "model": "tiny", "max_seq_len": 2048}
            ],
            "POST /v1/engines/{engine_id}/heartbeat": [{"stats": HEARTBEAT_STATS}, {}],
            "POST /v1/completions": COMPLETIONS,
        }
        options = bodies.get(route.key) or [example(route.body or {})]
        return data.draw(st.sampled_from(options), label="valid body")

    def after(route: Route, status: int) -> None:
        if route.key == "DELETE /v1/sessions/{session_id}" and ids.session_id not in manager.sessions:
            ids.create(live.url)  # the fuzzer closed it: a new one to name
            target.ids.update(ids.path_ids())
            target.auth_values[:] = [ids.token]

    target = Target(
        name="manager",
        live=live,
        routes=routes_of(app),
        ids={**ids.path_ids(), "engine_id": [handle.engine_id, remote.json()["engine_id"]]},
        valid_bodies=valid,
        auth_values=[ids.token],
        after=after,
    )
    yield target
    live.stop()


# ----------------------------------------------------------------- engine
ENGINE_PARENT = 7_000_001
"""The context the engine fuzzer forks from (filled before it starts, refilled if freed)."""


@pytest.fixture(scope="module")
def engine_target(tiny_model: LoadedModel) -> Iterator[Target]:
    """An engine process's app, guarded by the cluster secret, on loopback."""
    engine = LocalEngine(tiny_model)
    app = create_engine_app(engine, cluster_secret=TEST_CLUSTER_SECRET)
    live = serve_asgi(app, LiveServer(url="", manager=None), nodelay=True)  # type: ignore[arg-type]

    def fill_parent() -> None:
        body = {"tokens": [1, 2, 3, 4], "context_id": ENGINE_PARENT}
        resp = httpx.post(f"{live.url}/fill", json=body, headers=OPERATOR, timeout=30)
        assert resp.status_code == 200, resp.text

    fill_parent()
    fresh = st.integers(1, 2**62)  # a context id nobody uses (ids are random 63-bit numbers)
    either = st.one_of(fresh, st.just(ENGINE_PARENT))

    def valid(route: Route, data: st.DataObject) -> Any:
        if route.path == "/fill":
            return {
                "tokens": data.draw(st.lists(st.integers(0, 200), min_size=1, max_size=8)),
                "context_id": data.draw(either),
                "parent_context_id": data.draw(st.one_of(st.none(), st.just(ENGINE_PARENT))),
            }
        if route.path == "/generate":
            sampling = {"max_tokens": 2, "temperature": data.draw(st.sampled_from([0.0, 0.7]))}
            return {"sampling": sampling, "context_id": data.draw(fresh), "parent_context_id": ENGINE_PARENT}
        if route.path == "/free_context":
            return {"context_id": data.draw(either)}
        if route.path == "/token_capacity":
            return {"token_capacity": data.draw(st.sampled_from([4096, 8192]))}
        return example(route.body or {})

    def after(route: Route, status: int) -> None:
        if route.path == "/free_context" and ENGINE_PARENT not in live.run_on_loop(engine.context_ids()):
            fill_parent()

    target = Target(name="engine", live=live, routes=routes_of(app), ids={}, valid_bodies=valid, after=after)
    yield target
    live.stop()
    engine.close()


# ------------------------------------------------------------------ tests
def test_the_routes_come_from_the_schemas(manager_target: Target, engine_target: Target) -> None:
    manager_routes = {r.key for r in manager_target.routes}
    assert {
        "GET /healthz",
        "POST /v1/sessions",
        "POST /v1/sessions/{session_id}/calls",
        "POST /v1/completions",
        "POST /v1/engines",
        "GET /metrics",
        "GET /docs",
        "GET /redoc",
    } <= manager_routes
    engine_routes = {r.key for r in engine_target.routes}
    assert {"POST /fill", "POST /generate", "POST /free_context", "GET /stats"} <= engine_routes


@pytest.mark.timing
def test_no_manager_request_gets_a_5xx(manager_target: Target, error_log: ErrorLog) -> None:
    fuzz(manager_target, error_log)
    assert manager_target.covered == {r.key for r in manager_target.routes}


@pytest.mark.timing
def test_no_engine_request_gets_a_5xx(engine_target: Target, error_log: ErrorLog) -> None:
    fuzz(engine_target, error_log)
    assert engine_target.covered == {r.key for r in engine_target.routes}


class _Toy(StrictBody):
    x: int = 0


def toy_target(defect: str) -> Target:
    """A small app with one defect, for the fuzzer to find: a 500 for any ``x`` but 0, a
    stream that breaks off after its 200, or a handler that blocks the event loop once."""
    app = FastAPI()
    install_error_handlers(app)
    stalled = threading.Event()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.post("/toy")
    async def toy(body: _Toy) -> Any:
        if body.x == 0:
            return {}
        if defect == "500":
            raise RuntimeError("a bug")
        if defect == "stall":
            if not stalled.is_set():
                stalled.set()
                time.sleep(1.5)  # synchronous: nothing else runs on the loop meanwhile
            return {}

        async def lines() -> AsyncIterator[bytes]:
            yield b"{}\n"
            raise RuntimeError("a bug, half-way")

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    live = serve_asgi(app, LiveServer(url="", manager=None), nodelay=True)  # type: ignore[arg-type]
    routes = [r for r in routes_of(app) if r.path == "/toy"]
    return Target(name=defect, live=live, routes=routes, ids={}, valid_bodies=lambda route, data: {"x": 0})


@pytest.mark.parametrize(
    ("defect", "seen"),
    [("500", "500"), ("stream", "broke the connection"), ("stall", "/healthz took")],
)
def test_the_fuzzer_sees_a_defect(defect: str, seen: str, error_log: ErrorLog) -> None:
    """The harness itself: a 5xx, a response broken off, a blocked event loop each fail it."""
    target = toy_target(defect)
    try:
        with pytest.raises(AssertionError, match=seen):
            fuzz(target, error_log)
    finally:
        target.live.stop()
