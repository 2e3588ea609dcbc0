"""HTTP plumbing shared by the manager and engine apps: the one place that
maps exceptions to JSON error responses, and a request-body size limit.

Imported only by the apps (it needs FastAPI); nothing in the core imports it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from parrot.protocol.errors import ParrotError, PayloadTooLarge, QuotaExceeded

log = logging.getLogger(__name__)


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
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
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
