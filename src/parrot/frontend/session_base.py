"""What both session kinds share: the current session, paths, argument checks and
response handling (:class:`SessionBase`)."""

from __future__ import annotations

import json
import os
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

import httpx

from parrot.frontend.batching import RecordedBatch
from parrot.frontend.streaming import StreamEvent
from parrot.frontend.variable import SemanticVariable, check_value
from parrot.frontend.wire import (
    API_KEY_ENV,
    DEFAULT_TIMEOUT,
    ConnectionFailed,
    NoSession,
    error_from_info,
    parse_as,
    quote_part,
    record_info,
)
from parrot.protocol.errors import BadRequest, BindingError, ParrotError, Timeout
from parrot.protocol.schemas import CallSubmitted, VariableInfo

if TYPE_CHECKING:
    from parrot.frontend.async_session import AsyncSession, QueuedRequest
    from parrot.frontend.function import SemanticFunction
    from parrot.frontend.sync_session import Session

__all__ = ["CURRENT_SESSION", "SessionBase", "current_session"]

CURRENT_SESSION: ContextVar[Session | AsyncSession | None] = ContextVar("parrot_session", default=None)


def current_session() -> Session | AsyncSession:
    """The innermost session entered with ``with``/``async with`` in this context."""
    session = CURRENT_SESSION.get()
    if session is None:
        raise NoSession(
            "no Parrot session is active: call semantic functions inside `with P.connect(url):` "
            "or `async with P.aconnect(url):`, or use session.call(fn, ...)"
        )
    return session


class SessionBase:
    """What both session kinds share: paths, argument checks, response handling."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, api_key: str | None = None):
        if not isinstance(url, str) or not url.strip():
            raise BadRequest(f"manager URL must be a non-empty string, got {url!r}")
        self.url = url.strip().rstrip("/")
        # presented when the session is opened (the manager's tenants); later requests
        # present the session's own token
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout = float(timeout)
        self.session_id: str | None = None
        self.token: str | None = None
        self.closed = False
        self._ctx: list[Token[Session | AsyncSession | None]] = []
        self._batch: RecordedBatch | None = None  # while a batch() block records

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self.session_id else "not opened"
        return f"{type(self).__name__}({self.url!r}, session_id={self.session_id!r}, {state})"

    # --------------------------------------------------------------- paths
    @property
    def _sp(self) -> str:
        return f"/v1/sessions/{quote_part(self.session_id or '')}"

    @property
    def ui_url(self) -> str:
        """The manager's page that draws this session's DAG as it runs
        (``/ui/sessions/{id}``), with the session's token in the URL's fragment
        (``#token=...``): browsers never send a fragment to the server, and the page's
        script presents it as the ``Authorization`` header of its data requests.  The URL
        gives whoever holds it read access to the session: share it as the token."""
        if self.session_id is None or self.token is None:
            raise NoSession(f"session to {self.url} is not open yet: it has no page")
        return f"{self.url}/ui/sessions/{quote_part(self.session_id)}#token={quote_part(self.token)}"

    def _graph_params(self, value_chars: int) -> dict[str, str]:
        if isinstance(value_chars, bool) or not isinstance(value_chars, int) or value_chars < 0:
            raise BadRequest(f"value_chars must be an int >= 0, got {value_chars!r}")
        return {"value_chars": str(value_chars)} if value_chars else {}

    def _vp(self, var: SemanticVariable) -> str:
        return f"{self._sp}/variables/{quote_part(var.id or '')}"

    def _opening_headers(self) -> dict[str, str]:
        """The headers of a new HTTP client: the API key, if any, until a session token replaces it."""
        return {} if self._api_key is None else {"Authorization": f"Bearer {self._api_key}"}

    def _transport_error(self, method: str, path: str, exc: httpx.HTTPError) -> ParrotError:
        where = f"{method} {self.url}{path}"
        if isinstance(exc, httpx.TimeoutException):
            return Timeout(f"request to the Parrot manager timed out ({where}): {exc!r}")
        return ConnectionFailed(f"cannot reach the Parrot manager at {self.url} ({where}): {exc}")

    # -------------------------------------------------------------- checks
    def _require_open(self) -> None:
        if self.closed:
            raise NoSession(f"session {self.session_id} to {self.url} is closed")
        if self.session_id is None:
            raise NoSession(f"session to {self.url} is not open; use it in a with/async with block")

    def _start_batch(self, job: QueuedRequest | None, fetch_outputs: bool = False) -> RecordedBatch:
        self._require_open()
        if self._batch is not None:
            raise BadRequest("session.batch() blocks do not nest")
        self._batch = RecordedBatch(job, fetch_outputs=fetch_outputs)
        return self._batch

    def _check_sent(self, var: SemanticVariable) -> None:
        """Raise if ``var`` is created by the batch still being recorded (it has no id yet)."""
        if self._batch is not None and var in self._batch.refs:
            raise BadRequest(
                f"variable {var.name!r} is created by the batch being recorded; "
                "read it after the session.batch() block"
            )

    def _check_owned(self, var: SemanticVariable, what: str = "variable") -> None:
        if not isinstance(var, SemanticVariable):
            raise BadRequest(f"{what} must be a SemanticVariable, got {type(var).__name__}")
        if var.session is not self:
            raise BindingError(f"{what} {var!r} belongs to another session")

    def _bind(self, fn: SemanticFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        self._require_open()
        bound = fn.bind(args, kwargs)
        checked: dict[str, Any] = {}
        for name, value in bound.items():
            what = f"input {name!r} of {fn.__name__}()"
            if isinstance(value, SemanticVariable):
                self._check_owned(value, what)
                checked[name] = value
            else:
                checked[name] = check_value(value, what, variable_ok=True)
        return checked

    def _output_vars(self, fn: SemanticFunction, data: Any) -> list[SemanticVariable]:
        submitted = parse_as(CallSubmitted, data, f"submit of {fn.__name__}()")
        missing = [n for n in fn.outputs if n not in submitted.outputs]
        if missing:
            raise ParrotError(
                f"the manager's answer to {fn.__name__}() lacks output(s) {missing}", code="bad_response"
            )
        return [SemanticVariable(self, name=n, var_id=submitted.outputs[n]) for n in fn.outputs]  # type: ignore[arg-type]

    def _settle(self, var: SemanticVariable, data: Any) -> bool:
        """Record a ``VariableInfo``; True when ready, raises when failed."""
        record_info(var, parse_as(VariableInfo, data, f"variable {var.id}"))
        if var._error is not None:
            raise var._error
        return var._has_value

    def _stream_event(self, var: SemanticVariable, line: str) -> StreamEvent:
        """One NDJSON line -> its event; raises on a failed end."""
        if not line.strip():
            return StreamEvent()
        try:
            event = json.loads(line)
        except ValueError:
            raise ParrotError(
                f"stream of variable {var.id}: bad line {line[:200]!r}", code="bad_response"
            ) from None
        if not isinstance(event, dict):
            raise ParrotError(f"stream of variable {var.id}: bad line {line[:200]!r}", code="bad_response")
        if event.get("error") or event.get("state") == "failed":
            error = error_from_info(event.get("error"), f"variable {var.name or var.id}")
            var._fail(error)
            raise error
        if event.get("done"):
            value = event.get("value")
            if isinstance(value, str):
                var._resolve(value)
                return StreamEvent(done=True, value=value)
            return StreamEvent(done=True)
        if event.get("restart"):
            return StreamEvent(restart=True)
        text = event.get("text", "")
        return StreamEvent(text=text if isinstance(text, str) else "")

    def _cached(self, var: SemanticVariable) -> bool:
        if var._error is not None:
            raise var._error
        return var._has_value

    def _timeout_error(self, var: SemanticVariable, timeout: float | None) -> Timeout:
        label = f"{var.name!r} ({var.id})" if var.name else str(var.id)
        return Timeout(f"variable {label} not ready after {timeout} s")
