"""HTTP plumbing shared by the manager and engine apps: the one place that
maps exceptions to JSON error responses, a request-body size limit, and JSON
bodies parsed and checked off the event loop when they are large.

Imported only by the apps (it needs FastAPI); nothing in the core imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.protocol.errors import ParrotError, PayloadTooLarge, QuotaExceeded

log = logging.getLogger(__name__)

OFFLOOP_JSON_BYTES = 64 * 1024
"""A JSON body longer than this is parsed and checked in a worker thread: an 8 MiB body
takes the event loop ~0.1 s to parse and seconds to walk in Python."""

MAX_JSON_ITEMS = 300_000
"""The most JSON items a request body may hold, counted as its commas and opening brackets
(inside strings too: an upper bound, found by three byte scans).  Decoding holds the GIL
even in a worker thread, at 40-160 ns an item (a small object costs the most), and freeing
the result on the loop costs more, so this bounds how long any body holds the event loop
to ~30-60 ms (twice as many took 106-110 ms in a full test run).  A client with more values
splits them: 64 prompts of 4,096 token ids hold 262,208.  More is a 413
(:func:`parse_json_body`)."""

# a JSON escape of a UTF-16 surrogate (\ud800-\udfff); a body without one cannot hold a
# lone surrogate (raw UTF-8 cannot encode one, and invalid UTF-8 fails to parse)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_utf8(text: str) -> bool:
    """Whether ``text`` is encodable as UTF-8, i.e. holds no lone surrogate (C speed)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def reject_lone_surrogates(data: Any) -> Any:
    """``data`` unchanged; raises ValueError if a string in it (keys included, at any
    depth) holds a lone surrogate, which JSON's ``\\ud800`` escapes can carry but no
    UTF-8 text can: such a string would fail later, inside the tokenizer or a response.
    A walk over every item: callers run it only when the text had a surrogate escape."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _is_utf8(item):
                raise ValueError("invalid Unicode: a lone surrogate (U+D800-U+DFFF) is not text")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return data


class _CollectorPause:
    """Python's cyclic garbage collector off while any ``with`` block of this runs, in any
    thread (counted: the last block out turns it back on, if it was on when the first came
    in).  Decoding a large JSON body creates hundreds of thousands of lists and dicts, and
    each collection those allocations trigger traverses every tracked object of the server
    while the decoder holds the GIL: with GC on, a body of 300,000 small lists took 160-200 ms
    to decode in a process that had imported the manager, against ~40 ms with it off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._inside == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0 and self._was_enabled:
                    gc.enable()


collector_paused = _CollectorPause()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """While the block runs (a server serving), the objects alive when it began (the
    model, torch, the app: ~330,000 objects the collector tracks once the manager and the
    engine are imported) are out of the garbage collector's reach (``gc.freeze``).  A full
    collection walks every tracked object while it holds the GIL, on whichever thread
    allocated, the event loop's included: ~200 ms on this machine with them, ~0 ms
    without.  Frozen objects are still freed when their last reference goes.  A collection
    first, so that no garbage is frozen; unfrozen when the block ends, so that shutdown
    collects as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def json_items_bound(body: bytes) -> int:
    """An upper bound on the JSON items (values and keys) in ``body``: its commas and
    opening brackets, strings' included.  C-speed scans, ~7 ms for 8 MiB."""
    return body.count(b",") + body.count(b"[") + body.count(b"{")


def parse_json_body(body: bytes) -> Any:
    """A request body's JSON, refusing a body of more than :data:`MAX_JSON_ITEMS` items
    (HTTP 413, before decoding it) and invalid Unicode (HTTP 400 naming it).  A body over
    :data:`OFFLOOP_JSON_BYTES` is decoded with the garbage collector paused.  Raises
    ``json.JSONDecodeError`` for text that is not JSON (the framework's 400)."""
    if len(body) > MAX_JSON_ITEMS and json_items_bound(body) > MAX_JSON_ITEMS:
        raise HTTPException(
            413,
            detail=f"request body holds more than {MAX_JSON_ITEMS} JSON items (counted as its commas "
            "and opening brackets, in strings too): send fewer values per request",
        )
    if len(body) > OFFLOOP_JSON_BYTES:
        with collector_paused():
            data = json.loads(body)
    else:
        data = json.loads(body)
    if _SURROGATE_ESCAPE.search(body):
        try:
            reject_lone_surrogates(data)
        except ValueError as exc:
            raise HTTPException(400, detail=f"invalid request: body: {exc}") from None
    return data


class OffLoopJsonRequest(Request):
    """A request whose JSON body is parsed by :func:`parse_json_body`, in a worker thread
    when it is longer than :data:`OFFLOOP_JSON_BYTES`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFFLOOP_JSON_BYTES:
                self._json = await asyncio.to_thread(parse_json_body, body)
            else:
                self._json = parse_json_body(body)
        return self._json


class OffLoopJsonRoute(APIRoute):
    """The route class of every Parrot app: bodies parsed as :class:`OffLoopJsonRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_off_loop(request: Request) -> Response:
            return await handler(OffLoopJsonRequest(request.scope, request.receive))

        return parse_off_loop


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None for another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def error_response(err: ParrotError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, QuotaExceeded) else None
    return JSONResponse(err.to_body(), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ParrotError)
    async def _parrot(_: Request, exc: ParrotError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        msg = "invalid request: " + "; ".join(problems)
        return JSONResponse({"error": {"code": "invalid_request", "message": msg[:4000]}}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            400: "invalid_request",
            404: "not_found",
            405: "method_not_allowed",
            413: "payload_too_large",
        }.get(exc.status_code, "http_error")
        return JSONResponse(
            {"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(
            {"error": {"code": "internal_error", "message": f"internal error: {type(exc).__name__}"}},
            status_code=500,
        )


class BodyLimitMiddleware:
    """Reject request bodies over ``max_bytes`` with 413, whether or not they
    declare a Content-Length, before the application reads them."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await _send_json(send, too_large.status, too_large.to_body())
                    return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.extend(message.get("body", b""))
            if len(body) > self.max_bytes:
                await _send_json(send, too_large.status, too_large.to_body())
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


def ndjson_line(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
