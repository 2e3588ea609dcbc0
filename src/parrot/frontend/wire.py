"""The client's side of the manager's HTTP API: limits, errors, response decoding.

Every non-2xx answer with an ``{"error": ...}`` body becomes the very error class
the server raised (:func:`~parrot.protocol.errors.error_from_body`); an answer
that is not what the schema says becomes a ``bad_response`` ParrotError.
"""

from __future__ import annotations

from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from parrot.frontend.variable import SemanticVariable, check_value
from parrot.protocol.errors import BadRequest, CallFailed, ParrotError, error_from_body
from parrot.protocol.schemas import ErrorInfo, VariableInfo

DEFAULT_TIMEOUT = 30.0
"""Seconds allowed for an ordinary request (long polls get their ``wait`` on top)."""
API_KEY_ENV = "PARROT_API_KEY"
"""Where a session finds its API key when none is passed."""
POLL_MAX_WAIT = 30.0
"""Longest ``wait`` asked of the manager in one long poll."""
BACKOFF_START, BACKOFF_MAX = 0.01, 1.0
"""Sleeps between long polls the manager answered early (doubling)."""

_M = TypeVar("_M", bound=BaseModel)
Outputs = SemanticVariable | tuple[SemanticVariable, ...]


class ConnectionFailed(ParrotError):
    """The manager could not be reached (refused, DNS, reset, bad URL scheme)."""

    status = 503
    default_code = "connection_failed"


class NoSession(BadRequest):
    """A semantic function was called with no open session to submit to."""

    default_code = "no_session"


def raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_from_body(response.status_code, body)


def decode_json(response: httpx.Response, what: str) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise ParrotError(
            f"{what}: the manager answered with non-JSON content", code="bad_response"
        ) from None


def parse_as(model: type[_M], data: Any, what: str) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ParrotError(
            f"{what}: unexpected response from the manager: {exc}", code="bad_response"
        ) from None


def error_from_info(info: ErrorInfo | dict[str, Any] | None, what: str) -> ParrotError:
    if info is None:
        return CallFailed(f"{what} failed (the manager gave no reason)")
    body = info.model_dump() if isinstance(info, ErrorInfo) else info
    return error_from_body(CallFailed.status, {"error": body})


def record_info(var: SemanticVariable, info: VariableInfo) -> None:
    """Cache what a ``VariableInfo`` says of ``var``: its value when ready, its error when
    failed (nothing while pending); a ready variable without a value is a bad response."""
    if info.state == "ready":
        if info.value is None:
            raise ParrotError(f"variable {var.id} is ready but has no value", code="bad_response")
        var._resolve(info.value)
    elif info.state == "failed":
        var._fail(error_from_info(info.error, f"variable {var.name or var.id}"))


def fmt_wait(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def quote_part(part: str) -> str:
    return quote(part, safe="")


def one_or_tuple(outputs: list[SemanticVariable]) -> Outputs:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def create_body(value: Any, name: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if name is not None:
        if not isinstance(name, str):
            raise BadRequest(f"variable name must be a string, got {type(name).__name__}")
        body["name"] = name
    if value is not None:
        body["value"] = check_value(value, "variable value")
    return body
